"""The model repository on disk (Triton's layout):

    <repository>/<model>/config.pbtxt          optional where the engine says enough
    <repository>/<model>/<version>/model.kiln  a built engine, or
    <repository>/<model>/<version>/model.onnx  an ONNX model, built on load (cached)

A config without platform/backend is completed from the version folder's file; one without
inputs/outputs from the engine (as Triton auto-completes configs). Build options for ONNX
versions come from the config: ``instance_group.kind`` (KIND_GPU: cuda, KIND_CPU: cpu) and
``parameters`` ``fp16``/``bf16`` = ``"true"``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from kiln.serve import datatypes
from kiln.serve.config import ConfigError, check_config, model_suffix, parse_config
from kiln.serve.proto import model_config_pb2 as mc

SUFFIXES = (".kiln", ".onnx")


@dataclass
class ModelSource:
    """One model's folder as read now: its config (completed later) and version folders."""

    name: str
    path: Path
    config: mc.ModelConfig
    config_path: Path
    versions: dict[int, Path]


def file_signature(path: Path) -> tuple:
    out = []
    for root, _, files in os.walk(path):
        if ".kiln-cache" in root:
            continue
        for f in sorted(files):
            st = os.stat(os.path.join(root, f))
            out.append((os.path.join(root, f), st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


class Repository:
    def __init__(self, root: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(self.root, "model repository", "is not a folder")
        self.cache_dir = Path(cache_dir) if cache_dir else None

    def model_names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith("."))

    def read(self, name: str) -> ModelSource:
        path = self.root / name
        if not path.is_dir():
            raise ConfigError(path, "model", f"no folder '{name}' in {self.root}")
        cpath = path / "config.pbtxt"
        cfg = parse_config(cpath) if cpath.is_file() else mc.ModelConfig()
        versions = {int(p.name): p for p in path.iterdir() if p.is_dir() and p.name.isdigit()}
        return ModelSource(name, path, cfg, cpath, versions)


def select_versions(src: ModelSource) -> list[int]:
    """The versions the config's version_policy serves (default: the latest one)."""
    vp = src.config.version_policy
    have = sorted(src.versions)
    which = vp.WhichOneof("policy_choice")
    if which == "all":
        chosen = have
    elif which == "specific":
        missing = [v for v in vp.specific.versions if v not in src.versions]
        if missing:
            raise ConfigError(src.config_path, "version_policy.specific.versions",
                              f"version(s) {missing} have no folder in {src.path}")
        chosen = sorted(vp.specific.versions)
    else:
        n = vp.latest.num_versions if which == "latest" else 1
        chosen = have[-n:]
    if not chosen:
        raise ConfigError(src.path, "versions", "no numbered version folder (e.g. 1/) holds a "
                          "model")
    return chosen


def model_file(src: ModelSource, version: int) -> Path:
    vdir = src.versions[version]
    cfg = src.config
    if cfg.default_model_filename:
        f = vdir / cfg.default_model_filename
        if not f.is_file():
            raise ConfigError(src.config_path, "default_model_filename",
                              f"'{f}' does not exist")
        return f
    want = model_suffix(cfg, src.config_path)
    files = sorted(p for p in vdir.iterdir() if p.suffix in SUFFIXES and p.is_file())
    if want:
        files = [p for p in files if p.suffix == want]
    if not files:
        raise ConfigError(vdir, "model file", f"no {want or ' or '.join(SUFFIXES)} file in "
                          f"the version folder")
    if len(files) > 1:
        kiln_files = [p for p in files if p.suffix == ".kiln"]
        if len(kiln_files) != 1:
            raise ConfigError(vdir, "model file", f"several model files "
                              f"({', '.join(p.name for p in files)}); name one with "
                              f"default_model_filename")
        files = kiln_files
    return files[0]


def build_options(cfg: mc.ModelConfig) -> dict:
    kinds = {g.kind for g in cfg.instance_group}
    if mc.ModelInstanceGroup.KIND_GPU in kinds:
        device = "cuda"
    elif mc.ModelInstanceGroup.KIND_CPU in kinds:
        device = "cpu"
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    flag = {k: v.string_value.lower() == "true" for k, v in cfg.parameters.items()}
    return {"device": device, "fp16": flag.get("fp16", False), "bf16": flag.get("bf16", False)}


def load_engine(path: Path, cfg: mc.ModelConfig, cache_dir: Path | None, log=print):
    """A kiln engine from a .kiln file, or built from an .onnx (and cached by content)."""
    import kiln

    if path.suffix == ".kiln":
        return kiln.load(path)
    opts = build_options(cfg)
    digest = hashlib.sha256(path.read_bytes() + repr(sorted(opts.items())).encode())
    name = f"{path.stem}-{digest.hexdigest()[:16]}.kiln"
    cache = (cache_dir or path.parent / ".kiln-cache") / name
    if cache.is_file():
        try:
            return kiln.load(cache)
        except kiln.EngineFileError as e:  # built elsewhere or damaged: build again
            log(f"kiln serve: rebuilding {path} ({e})")
    log(f"kiln serve: building {path} ({', '.join(f'{k}={v}' for k, v in opts.items())})")
    engine = kiln.Builder(kiln.BuilderConfig(**opts)).build(str(path))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        engine.save(tmp)
        os.replace(tmp, cache)
    except OSError as e:  # a read-only repository still serves, it just builds every time
        log(f"kiln serve: cannot cache the engine at {cache} ({e})")
    return engine


def complete_config(src: ModelSource, engine, model_path: Path) -> mc.ModelConfig:
    """The config with name, platform and tensors filled in from the engine, checked against
    it; raises :class:`ConfigError` naming the field."""
    cfg = mc.ModelConfig()
    cfg.CopyFrom(src.config)
    cfg.name = cfg.name or src.name
    if not cfg.platform and not cfg.backend:
        cfg.platform = "kiln" if model_path.suffix == ".kiln" else "onnxruntime_onnx"
    nb = 1 if cfg.max_batch_size > 0 else 0
    for kind, have, infos in (("input", cfg.input, engine.inputs),
                              ("output", cfg.output, engine.outputs)):
        if not have:
            for info in infos:
                _fill_tensor(have.add(), info, nb, src.config_path, kind)
        else:
            _match_tensors(have, infos, nb, src.config_path, kind)
    check_config(cfg, src.config_path, src.name)
    return cfg


def _fill_tensor(t, info, nb: int, path, kind: str) -> None:
    t.name = info.name
    t.data_type = mc.DataType.Value(datatypes.to_config(datatypes.from_numpy(info.dtype.np)))
    shape = list(info.shape or ())
    if nb and (not shape or isinstance(shape[0], int) and shape[0] != -1):
        raise ConfigError(path, "max_batch_size", f"the engine's {kind} '{info.name}' has "
                          f"shape {info.shape_str()}, with no dynamic batch dim")
    t.dims.extend(d if isinstance(d, int) else -1 for d in shape[nb:])


def _match_tensors(have, infos, nb: int, path, kind: str) -> None:
    by_name = {i.name: i for i in infos}
    for k, t in enumerate(have):
        info = by_name.get(t.name)
        if info is None:
            raise ConfigError(path, f"{kind}[{k}].name", f"'{t.name}' is not an {kind} of the "
                              f"engine ({', '.join(by_name)})")
        want = datatypes.to_config(datatypes.from_numpy(info.dtype.np))
        if mc.DataType.Name(t.data_type) != want:
            raise ConfigError(path, f"{kind}[{k}].data_type", f"{mc.DataType.Name(t.data_type)}"
                              f" for '{t.name}', but the engine's is {want}")
        shape = list(info.shape or ())[nb:]
        dims = list(t.dims)
        if info.shape is not None and (len(dims) != len(shape) or any(
                isinstance(s, int) and d != -1 and s != d for s, d in zip(shape, dims))):
            raise ConfigError(path, f"{kind}[{k}].dims", f"{dims} for '{t.name}' do not fit "
                              f"the engine's shape {info.shape_str()}"
                              + (" past the batch dim" if nb else ""))
