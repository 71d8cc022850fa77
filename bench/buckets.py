"""One dynamic-batch CUDA engine against fixed-shape engines (issue 17: within 10% at b1, b8 and
the max batch).

Per corpus model: a kiln FP16 engine per batch in ``--batches`` with a fixed profile, and one
engine whose profile spans them (min = the smallest, opt = the middle one, max = the largest)
per ``--tune-at`` value (``all``: kernels timed at min, opt and max; ``opt``: TensorRT's way).
Every engine is timed at every batch it accepts, in this process, on the same GPU inputs
(``copy_outputs=False``, per call synchronized, median), and checked against the fixed engine's
outputs. Prints per batch the dynamic / fixed latency ratio.

    python -m bench.buckets --corpus DIR --models tv_resnet50_op17 --batches 1,8,64 \
        --tune-at all,opt --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.corpus import manifest


def _time(ctx, dev: dict, min_s: float = 0.3, min_iters: int = 20) -> float:
    import torch

    ctx.run(dev, copy_outputs=False)
    torch.cuda.synchronize()
    lat, end = [], time.perf_counter() + min_s
    while len(lat) < min_iters or time.perf_counter() < end:
        a = time.perf_counter()
        ctx.run(dev, copy_outputs=False)
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - a)
    return 1e3 * float(np.median(lat))


def run_model(entry, path: Path, batches: list[int], tune_at: list[str], tmp: Path) -> dict:
    import torch

    import kiln

    feeds = {b: entry.feeds(seed=0, batch=b) for b in batches}
    shapes = {b: {k: v.shape for k, v in f.items()} for b, f in feeds.items()}
    dev = {b: {k: torch.from_numpy(v.astype(np.float16) if v.dtype == np.float32 else v).cuda()
               for k, v in f.items()} for b, f in feeds.items()}
    cache = str(tmp / f"{entry.name}.cache")  # one timing cache: the same layer shapes time once

    def build(profile, at="all"):
        t0 = time.perf_counter()
        cfg = kiln.BuilderConfig(device="cuda", fp16=True, low_precision_io=True,
                                 timing_cache=cache, profiles=[profile], tune_at=at)
        eng = kiln.Builder(cfg).build(str(path))
        return eng, time.perf_counter() - t0

    row: dict = {"model": entry.name, "batches": batches, "fixed": {}, "dynamic": {}}
    ref = {}
    for b in batches:
        eng, secs = build(kiln.Profile.fixed(shapes[b]))
        ctx = eng.create_context()
        ref[b] = {k: v.float().cpu().numpy() for k, v in ctx.run(dev[b]).items()}
        row["fixed"][b] = {"ms": _time(ctx, dev[b]), "build_s": round(secs, 1)}
        del ctx, eng
    lo, mid, hi = batches[0], batches[len(batches) // 2], batches[-1]
    dyn = kiln.Profile(shapes[lo], shapes[mid], shapes[hi])
    for at in tune_at:
        eng, secs = build(dyn, at)
        ctx = eng.create_context()
        per = {"build_s": round(secs, 1)}
        for b in batches:
            out = {k: v.float().cpu().numpy() for k, v in ctx.run(dev[b]).items()}
            err = max(float(np.max(np.abs(out[k] - ref[b][k])) /
                            (float(np.max(np.abs(ref[b][k]))) + 1e-6)) for k in ref[b])
            ms = _time(ctx, dev[b])
            per[b] = {"ms": ms, "vs_fixed": ms / row["fixed"][b]["ms"], "rel_err": err}
        row["dynamic"][at] = per
        del ctx, eng
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=str(manifest.DEFAULT_DIR))
    p.add_argument("--models", required=True, help="comma-separated corpus model names")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--tune-at", default="all,opt")
    p.add_argument("--json")
    args = p.parse_args(argv)
    corpus = Path(args.corpus)
    entries = manifest.load(corpus)
    batches = sorted(int(b) for b in args.batches.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            entry = entries[name]
            if not entry.batch_dynamic:
                rows.append({"model": name, "error": "its batch dim is not dynamic"})
                continue
            try:
                rows.append(run_model(entry, corpus / entry.file, batches,
                                      args.tune_at.split(","), Path(tmp)))
            except Exception as e:  # one model's failure is a row, not the end of the run
                rows.append({"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            r = rows[-1]
            if "error" in r:
                print(f"{name}: {r['error']}", flush=True)
            for at, per in r.get("dynamic", {}).items():
                cells = ", ".join(f"b{b} {per[b]['ms']:.3f} ms = {per[b]['vs_fixed']:.2f}x fixed"
                                  f" (err {per[b]['rel_err']:.1e})" for b in batches)
                print(f"{name} tune_at={at} (build {per['build_s']} s): {cells}", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "command": "python -m bench.buckets "
           + " ".join(sys.argv[1:] if argv is None else argv), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
