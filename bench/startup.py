"""Build, load and first-run times of corpus models, and steady-state latency against
onnxruntime, in one process (2 threads each).

    python -m bench.startup silero_vad_v5 ppocr_det_v4 [--runs 30] [--no-loop]

Per model: the CPU build cold (no timing cache, the process's tactic picks cleared) and warm
(the cold build's timing cache), engine load, load + first run, the steady-state median of kiln
(native programs), of the same engine on the executor's Python loop (``--no-loop`` skips it),
and of onnxruntime, with the targets of issue 16 (load + first <= 2 x median + 50 ms, build
<= 15 s cold and <= 3 s warm). Models come from the corpus cache (``~/.cache/kiln/corpus``,
made by ``python -m bench.corpus``); each input gets the shape its manifest entry names.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.corpus.measure import median_s

CORPUS = Path(os.environ.get("KILN_CORPUS_DIR", Path.home() / ".cache/kiln/corpus"))


def _feeds(entry: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in entry["inputs"]:
        shape, dt = tuple(i["shape"]), np.dtype(i["dtype"])
        if i.get("value") is not None:
            feeds[i["name"]] = np.full(shape, i["value"], dt)
        elif dt.kind in "iu":
            lo, hi = i.get("low") or 0, i.get("high") or 100
            feeds[i["name"]] = rng.integers(lo, hi, shape).astype(dt)
        elif dt == np.bool_:
            feeds[i["name"]] = np.ones(shape, dt)
        else:
            feeds[i["name"]] = rng.standard_normal(shape).astype(dt)
    return feeds


def measure(name: str, entry: dict, runs: int, loop: bool, tmp: Path) -> dict:
    import onnxruntime as ort

    import kiln
    from kiln.kernels.torch import fused_conv as FCK

    path = str(CORPUS / entry["file"])
    feeds = _feeds(entry)
    profile = kiln.Profile.fixed({k: v.shape for k, v in feeds.items()})
    cache = tmp / f"{name}.timing.json"
    row = {"model": name}
    for kind in ("cold", "warm"):
        FCK._choices.clear()  # as in a fresh process
        cfg = kiln.BuilderConfig(device="cpu", profiles=[profile], timing_cache=str(cache))
        t0 = time.perf_counter()
        engine = kiln.Builder(cfg).build(path)
        row[f"build_{kind}_s"] = time.perf_counter() - t0
    engine.save(tmp / f"{name}.kiln")
    del engine
    FCK._choices.clear()
    t0 = time.perf_counter()
    engine = kiln.load(tmp / f"{name}.kiln")
    ctx = engine.create_context()
    row["load_ms"] = 1e3 * (time.perf_counter() - t0)
    ctx.run(feeds)
    row["load_first_ms"] = 1e3 * (time.perf_counter() - t0)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    fns = {"kiln": lambda: ctx.run(feeds), "onnxruntime": lambda: sess.run(None, feeds)}
    if loop:
        plain = kiln.load(tmp / f"{name}.kiln")
        for ex in plain._executors:
            ex.program = None
        pctx = plain.create_context()
        fns["kiln_loop"] = lambda: pctx.run(feeds)
    best = {k: float("inf") for k in fns}
    for _ in range(2):  # interleaved twice, the better median kept
        for k, fn in fns.items():
            best[k] = min(best[k], 1e3 * median_s(fn, runs))
    row.update({f"{k}_ms": v for k, v in best.items()})
    row["ratio"] = best["kiln"] / best["onnxruntime"]
    row["first_ok"] = row["load_first_ms"] <= 2 * best["kiln"] + 50
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--no-loop", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    manifest = json.loads((CORPUS / "manifest.json").read_text())["models"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            row = measure(name, manifest[name], args.runs, not args.no_loop, Path(tmp))
            rows.append(row)
            loop = f" loop {row['kiln_loop_ms']:.2f}" if "kiln_loop_ms" in row else ""
            print(f"{name:28s} build {row['build_cold_s']:5.1f}/{row['build_warm_s']:4.1f} s  "
                  f"load {row['load_ms']:6.1f} ms  load+first {row['load_first_ms']:7.1f} ms "
                  f"({'ok' if row['first_ok'] else 'over'})  kiln {row['kiln_ms']:7.2f}{loop}  "
                  f"ort {row['onnxruntime_ms']:7.2f} ms  {row['ratio']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
