"""kiln run: run an engine once and summarise its outputs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kiln.cli.args import add_common_args, parse_shapes
from kiln.errors import KilnError

NAME = "run"
HELP = "run an engine (or ONNX model) once on given or random inputs"


def add_arguments(p):
    p.add_argument("engine", help="engine file (.kiln) or ONNX model")
    p.add_argument("--input", action="append", default=[], metavar="NAME:FILE.npy",
                   help="input data from a .npy file (repeatable); others are random")
    p.add_argument("--shapes", help="shapes for random inputs with dynamic dims")
    p.add_argument("--output-dir", help="save every output as OUTPUT_DIR/<name>.npy")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--portable", action="store_true",
                   help="load a CUDA engine built on another GPU model or software versions")
    add_common_args(p)


def open_engine(path: str, portable: bool = False):
    """An engine from a .kiln file, or built in memory from an ONNX model."""
    import kiln

    if path.endswith(".onnx"):
        return kiln.Builder().build(path)
    return kiln.load(path, portable=portable)


def load_inputs(items: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for item in items:
        name, sep, file = item.rpartition(":")
        if not sep:
            raise KilnError(f"bad --input '{item}': write it as name:file.npy")
        if not Path(file).is_file():
            raise KilnError(f"input file '{file}' for '{name}' does not exist")
        out[name] = np.load(file, allow_pickle=False)
    return out


def main(args) -> int:
    from kiln.engine.inputs import random_inputs

    engine = open_engine(args.engine, args.portable)
    given = load_inputs(args.input)
    missing = [i for i in engine.inputs if i.name not in given]
    profile = engine.profiles[0] if engine.profiles else None
    feeds = dict(given, **random_inputs(missing, parse_shapes(args.shapes), profile, args.seed))
    ctx = engine.create_context()
    t0 = time.perf_counter()
    outs = ctx.run(feeds)
    dt = time.perf_counter() - t0
    for name, x in feeds.items():
        print(f"input  {name:<24} {str(x.dtype):<8} {'x'.join(map(str, x.shape)) or 'scalar'}")
    for name, y in outs.items():
        print(f"output {name:<24} {_summary(y)}")
    print(f"ran in {1e3 * dt:.2f} ms")
    if args.output_dir:
        d = Path(args.output_dir)
        d.mkdir(parents=True, exist_ok=True)
        for name, y in outs.items():
            np.save(d / f"{_safe(name)}.npy", np.asarray(y), allow_pickle=False)
        print(f"saved {len(outs)} output(s) to {d}/")
    return 0


def _summary(y) -> str:
    y = np.asarray(y)
    shape = "x".join(map(str, y.shape)) or "scalar"
    if y.dtype.kind in "fiu" and y.size:
        f = y.astype(np.float64)
        return (f"{str(y.dtype):<8} {shape:<16} min {f.min():.4g}  max {f.max():.4g}  "
                f"mean {f.mean():.4g}  std {f.std():.4g}")
    return f"{str(y.dtype):<8} {shape}"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
