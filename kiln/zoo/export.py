"""Build, export and cache the reference models as ONNX files.

Files are cached under :func:`cache_dir` keyed by model name, options and a digest of the
model's source code, so a second :func:`build_onnx` call returns at once and editing a model
definition invalidates its cache entry.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from kiln.zoo import bert, gpt2, minilm, resnet

OPSET = 17
FORMAT_VERSION = "1"  # bump to invalidate every cached export


@dataclass(frozen=True)
class ZooModel:
    """One reference model: the module that builds it, plus modules its code depends on."""

    module: ModuleType
    depends: tuple[ModuleType, ...] = ()

    @property
    def sources(self) -> tuple[ModuleType, ...]:
        return (self.module, *self.depends)


MODELS: dict[str, ZooModel] = {
    "resnet50": ZooModel(resnet),
    "bert-base": ZooModel(bert),
    "gpt2": ZooModel(gpt2, depends=(bert,)),
    "minilm": ZooModel(minilm, depends=(bert,)),
}


def cache_dir() -> Path:
    """Where exported models live: ``$KILN_CACHE_DIR/zoo`` (default ``~/.cache/kiln/zoo``).

    This is the only place that reads ``KILN_CACHE_DIR``.
    """
    root = os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln"
    return Path(root).expanduser() / "zoo"


def list_models() -> list[str]:
    """Names accepted by :func:`build_onnx` and :func:`sample_inputs`."""
    return list(MODELS)


def _entry(name: str) -> ZooModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}") from None


def _check_options(name: str, opts: dict) -> None:
    try:
        inspect.signature(_entry(name).module.build).bind(**opts)
    except TypeError as exc:
        raise ValueError(f"bad options for zoo model {name!r}: {exc}") from None


def _options_tag(opts: dict) -> str:
    return "".join(f"-{k}{v}" for k, v in sorted(opts.items()))


def _digest(name: str, opts: dict, seed: int) -> str:
    h = hashlib.sha256(f"{FORMAT_VERSION}|{OPSET}|{name}|{sorted(opts.items())}|{seed}".encode())
    for mod in _entry(name).sources:
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:10]


def cache_path(name: str, seed: int = 0, **opts: object) -> Path:
    """The cache file :func:`build_onnx` uses for ``name`` with ``opts`` (may not exist yet)."""
    _check_options(name, opts)
    return cache_dir() / f"{name}{_options_tag(opts)}-{_digest(name, opts, seed)}.onnx"


def _export(name: str, opts: dict, seed: int, dest: Path) -> None:
    """Build the torch model with fixed seeds and export it to ``dest`` atomically."""
    mod = _entry(name).module
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with torch.random.fork_rng(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model, args = mod.build(**opts)
        try:
            torch.onnx.export(
                model, args, str(tmp), dynamo=False, opset_version=OPSET,
                input_names=mod.INPUT_NAMES, output_names=mod.OUTPUT_NAMES,
                dynamic_axes=mod.DYNAMIC_AXES, do_constant_folding=True)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)


def _prune_stale(fresh: Path) -> None:
    """Remove older exports of the same name+options (other source digests)."""
    stem = fresh.name[: -len("-0123456789.onnx")]
    pattern = re.compile(re.escape(stem) + r"-[0-9a-f]{10}\.onnx")
    for old in fresh.parent.glob(f"{stem}-*.onnx"):
        if old != fresh and pattern.fullmatch(old.name):
            old.unlink(missing_ok=True)


def _place(src: Path, dest: Path) -> Path:
    """Atomically put a copy (hard link when possible) of ``src`` at ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    return dest


def build_onnx(name: str, path: str | os.PathLike | None = None, seed: int = 0,
               verbose: bool = False, **opts: object) -> Path:
    """Return the path of the ONNX export of zoo model ``name``, building it if needed.

    ``name`` is one of :func:`list_models`; ``opts`` override the model's hyper-parameters
    (e.g. ``layers=2`` for bert-base/gpt2, ``weights="random"`` for minilm without its package).
    Models are exported with the TorchScript exporter at opset 17 with dynamic batch (and
    sequence) axes, and cached under :func:`cache_dir`.
    With ``path`` the file is also placed there (hard link or copy) and ``path`` is returned.
    """
    cached = cache_path(name, seed, **opts)
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        _export(name, opts, seed, cached)
        _prune_stale(cached)
        if verbose:
            mib = cached.stat().st_size / 2**20
            print(f"exported {name} in {time.perf_counter() - start:.1f}s ({mib:.0f} MiB)")
    return cached if path is None else _place(cached, Path(path))


def sample_inputs(name: str, batch: int, seq: int = 128, seed: int = 0,
                  **opts: object) -> dict[str, np.ndarray]:
    """Realistic inputs for zoo model ``name``, keyed by graph input name.

    Images are N(0, 1) float32 [batch, 3, 224, 224] (``seq`` ignored); text models get int64
    ids [batch, seq] (random in-vocab ids; real tokenized sentences for minilm unless
    ``weights="random"``) and, for the BERT family, an attention mask that pads every row but
    the first when ``batch > 1``.
    ``opts`` are the build options (e.g. ``vocab``) so small variants get matching inputs.
    """
    rng = np.random.default_rng(seed)
    return _entry(name).module.sample_inputs(batch, seq, rng, **opts)
