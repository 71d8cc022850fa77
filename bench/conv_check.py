"""Channels-last CUDA convs (issue #6): kiln FP16 ResNet-50, NHWC path against the old NCHW one.

    PYTHONPATH=. python bench/conv_check.py [--batches 1,256] [--runs 30] [--warmup 10]

Builds the zoo ResNet-50 with ``BuilderConfig(device="cuda", fp16=True)`` once, then for each
mode (``fused_conv.CUDA_CHANNELS_LAST`` True: convs channels-last, False: the old NCHW path)
and batch makes a fresh context (CUDA graphs on; the switch is read while the graph is
captured, so each mode gets its own capture), runs it with torch CUDA inputs, checks that the two
modes agree (max|nhwc - nchw| / max|nchw| <= 2e-2) and prints the median ms of ``--runs`` timed
runs (torch.cuda.Event around each ``ctx.run``, after ``--warmup`` runs; the first of those
captures the graph). Exits 1 when a check fails. Takes well under two minutes on an H200
(most of it the ONNX export, when the zoo cache is cold).
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import sys
import time

import torch

import kiln
from kiln.kernels.torch import fused_conv
from kiln.zoo import build_onnx, sample_inputs

TOL = 2e-2
MODES = (("nhwc", True), ("nchw", False))


def time_ctx(ctx, feeds: dict, runs: int, warmup: int) -> tuple[float, torch.Tensor, str]:
    """(median ms, the output of the last run, the context's capture decision)."""
    out = None
    for _ in range(warmup):
        out = ctx.run(feeds)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = ctx.run(feeds)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    y = next(iter(out.values())).float().clone()
    decision = next(iter(ctx.cuda.decisions.values()), "?")
    return statistics.median(times), y, decision


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,256")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    faulthandler.dump_traceback_later(170, exit=True)  # never hang the lead's session
    if not torch.cuda.is_available():
        print("conv_check: no CUDA device")
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    path = build_onnx("resnet50")
    t1 = time.perf_counter()
    engine = kiln.Builder(kiln.BuilderConfig(device="cuda", fp16=True)).build(str(path))
    t2 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | export/cache "
          f"{t1 - t0:.1f} s, build {t2 - t1:.1f} s, {len(engine.graph.nodes)} layers, "
          f"ops {engine.graph.op_counts()}")
    res: dict = {}
    ok = True
    try:
        for b in batches:
            feeds = {k: torch.from_numpy(v).cuda() for k, v in
                     sample_inputs("resnet50", batch=b).items()}
            for mode, on in MODES:
                fused_conv.CUDA_CHANNELS_LAST = on
                ctx = engine.create_context(cuda_graph=True)
                res[(mode, b)] = time_ctx(ctx, feeds, args.runs, args.warmup)
                del ctx
                torch.cuda.empty_cache()
    finally:
        fused_conv.CUDA_CHANNELS_LAST = True
    print(f"\n{'batch':>5} {'mode':>5} {'median ms':>10} {'img/s':>9}  decision")
    for b in batches:
        for mode, _ in MODES:
            ms, _, dec = res[(mode, b)]
            print(f"{b:>5} {mode:>5} {ms:>10.3f} {b / ms * 1e3:>9.0f}  {dec}")
    print()
    for b in batches:
        y, ref = res[("nhwc", b)][1], res[("nchw", b)][1]
        err = float((y - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
        good = bool(torch.isfinite(y).all()) and err <= TOL and y.shape == ref.shape
        ok &= good
        speed = res[("nchw", b)][0] / res[("nhwc", b)][0]
        print(f"batch {b}: max|nhwc - nchw| / max|nchw| = {err:.2e} "
              f"({'ok' if good else 'FAIL'}, tol {TOL}); nhwc is {speed:.2f}x the nchw speed")
    print(f"total {time.perf_counter() - t0:.1f} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
