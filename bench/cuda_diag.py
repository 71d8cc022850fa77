"""Diagnostics for the CUDA backend (where time goes at load and at big batch).

    PYTHONPATH=. python bench/cuda_diag.py --out OUTDIR [--parts load,profile]

``load``: builds ResNet-50 FP16 engines (per ``--batches``; twice through one timing cache),
then in fresh processes, each with an empty Triton cache, times load + first inference (and a
cProfile of one). ``profile``: a torch.profiler table of kiln's ResNet-50 FP16 b256 run (eager
launches) next to PyTorch eager FP16 channels-last's (needs 256 in ``--batches``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r'''
import os, sys, time, json
t_imp = time.perf_counter()
import torch, numpy as np
import kiln
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
import kiln.kernels.triton
t_ready = time.perf_counter()
path, prof = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).standard_normal((int(sys.argv[3]), 3, 224, 224)).astype(np.float32)
def go():
    t0 = time.perf_counter()
    e = kiln.load(path)
    t1 = time.perf_counter()
    ctx = e.create_context()
    ctx.run({e.inputs[0].name: x})
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return e, ctx, t1 - t0, t2 - t1
if prof != "-":
    import cProfile, pstats, io
    pr = cProfile.Profile(); pr.enable(); e, ctx, a, b = go(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
    open(prof, "w").write(s.getvalue())
else:
    e, ctx, a, b = go()
feeds = {e.inputs[0].name: x}
for _ in range(3): ctx.run(feeds)
torch.cuda.synchronize()
lat = []
for _ in range(30):
    t = time.perf_counter(); ctx.run(feeds); lat.append(time.perf_counter() - t)
lat.sort()
from kiln.kernels.triton import binary
tc = os.environ.get("TRITON_CACHE_DIR")
n_cache = sum(1 for _ in __import__("pathlib").Path(tc).rglob("*")) if tc else None
print(json.dumps({"import_s": t_ready - t_imp, "load_s": a, "first_run_s": b,
                  "installed": binary.installed(), "binaries_note": e.binaries_note,
                  "triton_cache_files_after": n_cache,
                  "steady_median_ms": 1e3 * lat[len(lat) // 2],
                  "decisions": {str(k): v for k, v in ctx.cuda.decisions.items()}}))
'''


def child(path, batch, env, prof="-"):
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), prof, str(batch)], env=env,
                       capture_output=True, text=True, timeout=240)
    if r.returncode:
        return {"error": r.stderr[-3000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def build(batch, path, log, timing_cache=None):
    import kiln
    from kiln.zoo import build_onnx

    onnx = str(build_onnx("resnet50"))  # exported (and cached) outside the build's time
    t = time.perf_counter()
    cfg = kiln.BuilderConfig(device="cuda", fp16=True, timing_cache=timing_cache, profiles=[
        kiln.Profile.fixed({"input": (batch, 3, 224, 224)})])
    eng = kiln.Builder(cfg, log=log).build(onnx)
    eng.save(path)
    return time.perf_counter() - t


def part_load(out: Path, res: dict, batches: list[int]):
    """Builds (twice through one timing cache: the rebuild times nothing), then load + first
    inference in fresh processes, each with an empty Triton cache (so nothing can hide a
    compile: the engine's embedded kernels are all it has)."""
    tmp = Path(tempfile.mkdtemp())
    os.environ["TRITON_CACHE_DIR"] = str(tmp / "tc-build")
    lines = []
    cache = str(tmp / "timing.json")
    for b in batches:
        res[f"build_b{b}_s"] = build(b, tmp / f"r{b}.kiln", lines.append, cache)
        res[f"rebuild_b{b}_s"] = build(b, tmp / f"r{b}-again.kiln", lines.append, cache)
    (out / "build_log.txt").write_text("\n".join(lines))
    if Path(cache).exists():  # every candidate's time, for reading offline
        (out / "timing_cache.json").write_text(Path(cache).read_text())
    env = dict(os.environ, PYTHONPATH=os.getcwd())

    def fresh(tag: str) -> dict:  # an empty Triton cache: nothing to find, so nothing hides
        d = tmp / f"tc-{tag}"
        d.mkdir()
        return dict(env, TRITON_CACHE_DIR=str(d))

    for b in batches:
        for rep in range(2):
            res[f"b{b}_{rep}"] = child(tmp / f"r{b}.kiln", b, fresh(f"b{b}-{rep}"))
        res[f"b{b}_profiled"] = child(tmp / f"r{b}.kiln", b, fresh(f"b{b}p"),
                                      str(out / f"load_cprofile_b{b}.txt"))
    return tmp


def part_profile(out: Path, res: dict, tmp: Path):
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kiln
    from kiln.zoo import resnet

    x = np.random.default_rng(0).standard_normal((256, 3, 224, 224)).astype(np.float32)
    e = kiln.load(tmp / "r256.kiln")
    ctx = e.create_context(cuda_graph=False)
    xt = torch.from_numpy(x).cuda()
    feeds = {e.inputs[0].name: xt}
    for _ in range(3):
        ctx.run(feeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            ctx.run(feeds)
        torch.cuda.synchronize()
    (out / "kiln_b256_profile.txt").write_text(
        p.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
    torch.manual_seed(0)
    m, _ = resnet.build()
    m = m.eval().cuda().half().to(memory_format=torch.channels_last)
    xh = xt.half().contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(3):
            m(xh)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                m(xh)
            torch.cuda.synchronize()
    (out / "eager_b256_profile.txt").write_text(
        p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    res["layers_b256"] = [(r["name"], r["op"], round(r["median_ms"], 3)) for r in
                          __import__("kiln.perf.layers", fromlist=["x"]).profile_layers(
                              e, [xt], runs=3)[:40]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="load,profile")
    ap.add_argument("--batches", default="1,256")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    try:
        tmp = part_load(out, res, [int(b) for b in a.batches.split(",")])
        (out / "diag.json").write_text(json.dumps(res, indent=1, default=str))
        if "profile" in a.parts:
            part_profile(out, res, tmp)
    finally:
        (out / "diag.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
