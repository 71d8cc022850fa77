"""Where a CUDA engine's cold start goes: fresh processes that load an engine and run it once,
after first warming nothing, cuBLAS, cuDNN (a tiny matmul / conv before ``kiln.load``) or
Triton (imported), or nothing under cProfile (``profile``: its table is kept in the row), so
the library initialisations the first inference pays show up as differences.

    python -m bench.cold_parts --corpus .gpu/corpus --models hf_bert_sdpa_op17 \\
        --plan-margins 0.25,10 --json out.json

Per model and ``plan_margin`` (10: a layer keeps an embedded kernel unless a cuDNN one is 11x
faster, i.e. no cuDNN): one FP16 b1 engine built with a fixed profile (low-precision I/O), its
layers counted by kernel and by whether they make a cuDNN plan, its steady-state median
(CUDA events, 200 runs), then per warm-up variant a fresh process's load, first run and second
run in ms. Each process does ``import torch, kiln`` and CUDA init before the clock starts, as
the corpus's cold-start column does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FRESH = r"""
import json, sys, time
import numpy as np
import torch
import kiln
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
warm = sys.argv[3]
t = time.perf_counter()
if warm in ("cublas", "both"):
    a = torch.randn(64, 64, device="cuda", dtype=torch.half); (a @ a).sum().item()
if warm == "triton":  # what importing Triton would cost: kiln imports it only to compile
    import triton  # noqa: F401
if warm in ("cudnn", "both"):
    x = torch.randn(1, 8, 16, 16, device="cuda", dtype=torch.half)
    torch.nn.functional.conv2d(x, torch.randn(8, 1, 3, 3, device="cuda", dtype=torch.half),
                               groups=8).sum().item()
warm_ms = 1e3 * (time.perf_counter() - t)
feeds = dict(np.load(sys.argv[2]))
prof = None
if warm == "profile":  # cProfile over load + first run: where the time goes
    import cProfile
    prof = cProfile.Profile(); prof.enable()
t0 = time.perf_counter()
engine = kiln.load(sys.argv[1])
t1 = time.perf_counter()
ctx = engine.create_context()
fd = {i.name: feeds[i.name].astype(i.dtype.np, copy=False) for i in engine.inputs}
out = ctx.run(fd)
{k: v.cpu() if hasattr(v, "cpu") else v for k, v in out.items()}
t2 = time.perf_counter()
if prof is not None:
    import io, pstats
    prof.disable(); buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
    print(buf.getvalue()[-9000:], file=sys.stderr)
out = ctx.run(fd)
{k: v.cpu() if hasattr(v, "cpu") else v for k, v in out.items()}
t3 = time.perf_counter()
print(json.dumps({"warm": warm, "warm_ms": warm_ms, "load_ms": 1e3 * (t1 - t0),
                  "first_run_ms": 1e3 * (t2 - t1), "load_first_run_ms": 1e3 * (t2 - t0),
                  "second_run_ms": 1e3 * (t3 - t2)}))
"""


def _steady_ms(engine, feeds: dict, runs: int = 200) -> float:
    import torch

    ctx = engine.create_context()
    dev = {i.name: torch.from_numpy(feeds[i.name].astype(i.dtype.np, copy=False)).cuda()
           for i in engine.inputs}
    for _ in range(20):
        ctx.run(dev, copy_outputs=False)
    ms = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ctx.run(dev, copy_outputs=False)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return float(np.median(ms))


def _kernels(engine) -> dict:
    """Layers per kernel name, and how many make a cuDNN plan at their first call."""
    from kiln.kernels import registry

    by_name = {k.name: k for ks in registry._KERNELS.values() for k in ks
               if k.backend == "cuda"}
    counts: dict[str, int] = {}
    plans = []
    for layer in engine.layers():
        counts[layer["kernel"]] = counts.get(layer["kernel"], 0) + 1
        k = by_name.get(layer["kernel"])
        if k is not None and k.plans(layer["tactic"]):
            plans.append(layer["name"])
    return {"by_kernel": counts, "cudnn_plan_layers": len(plans), "cudnn_layers": plans[:20]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--models", required=True)
    p.add_argument("--plan-margins", default="0.25,10")
    p.add_argument("--warm", default="none,cublas,cudnn,both,triton")
    p.add_argument("--json")
    a = p.parse_args(argv)

    import kiln
    from bench.corpus import manifest

    entries = manifest.load(a.corpus)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-cold-"))
    rows = []
    for name in a.models.split(","):
        entry = entries[name]
        feeds = entry.feeds(batch=1)
        npz = tmp / f"{name}.npz"
        np.savez(npz, **feeds)
        for margin in (float(m) for m in a.plan_margins.split(",")):
            cfg = kiln.BuilderConfig(
                device="cuda", fp16=True, low_precision_io=True, plan_margin=margin,
                timing_cache=str(tmp / f"{name}.cache"),
                profiles=[kiln.Profile.fixed({k: v.shape for k, v in feeds.items()})])
            t0 = time.perf_counter()
            engine = kiln.Builder(cfg).build(str(Path(a.corpus) / entry.file))
            row = {"model": name, "plan_margin": margin,
                   "build_s": time.perf_counter() - t0}
            path = tmp / f"{name}-{margin}.kiln"
            engine.save(path)
            try:
                row.update(_kernels(engine))
            except Exception as e:  # the breakdown is a diagnosis; the timings still count
                row["kernels_error"] = f"{type(e).__name__}: {e}"
            row["steady_ms"] = _steady_ms(engine, feeds)
            del engine
            row["fresh"] = []
            for warm in a.warm.split(","):
                proc = subprocess.run([sys.executable, "-c", FRESH, str(path), str(npz), warm],
                                      capture_output=True, text=True, timeout=120,
                                      cwd=Path(__file__).resolve().parents[1])
                if proc.returncode != 0:
                    row["fresh"].append({"warm": warm, "error": proc.stderr[-500:]})
                else:
                    row["fresh"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                    if warm == "profile":
                        row["fresh"][-1]["profile"] = proc.stderr[-9000:]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
