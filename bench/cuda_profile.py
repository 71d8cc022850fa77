"""Where a kiln CUDA engine's time goes, kernel by kernel, beside torch eager on the same module.

    python -m bench.cuda_profile --corpus DIR --model tv_resnet50_op17 --batch 256 [--no-tune]
        [--peer] [--iters 20] [--json OUT]

Builds kiln FP16 (fixed profile at the batch, FP16 I/O, tuned unless ``--no-tune``; a timing
cache beside the engine), times it per call and back-to-back (CUDA events), then records
``--iters`` calls under ``torch.profiler`` and prints the kernels by total device time: name,
calls per inference, ms per inference, share. ``kernel sum`` against the back-to-back time says
how much of a call is device work and how much is gaps between kernels (host overhead).
``--peer`` does the same for the model's torch definition in eager FP16 (cuDNN/cuBLAS), the
kernel mix a fast engine should at least match.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path


def event_ms(fn, iters: int) -> tuple[float, float]:
    """(median per-call ms, back-to-back ms per call) with CUDA events."""
    import torch

    from bench.llm_attention import median_call_s

    per = 1e3 * median_call_s(fn, iters, "cuda", warmup=0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return per, a.elapsed_time(b) / iters


def kernel_table(fn, iters: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total / 1e3  # ms
            count[e.name] += 1
    s = sum(total.values())
    rows = sorted(total, key=total.get, reverse=True)[:top]
    return {"kernel_sum_ms": s / iters, "kernels_per_call": sum(count.values()) / iters,
            "top": [{"name": n[:120], "calls": count[n] / iters, "ms": total[n] / iters,
                     "share": total[n] / s if s else 0.0} for n in rows]}


def kiln_fn(path: Path, feeds: dict, tune: bool, tmp: Path, precision: str = "fp16",
            calib: list | None = None):
    import torch

    import kiln

    cache = tmp / f"{path.stem}.cache"
    low = {"int8": dict(int8=True, calib=calib), "fp8": dict(fp8=True, calib=calib)}
    cfg = kiln.BuilderConfig(device="cuda", fp16=True, low_precision_io=True, tune=tune,
                             timing_cache=str(cache), **low.get(precision, {}),
                             profiles=[kiln.Profile.fixed({k: v.shape for k, v in feeds.items()})])
    t0 = time.perf_counter()
    lines: list[str] = []
    builder = kiln.Builder(cfg, log=lines.append)
    engine = builder.build(str(path))
    build_s = time.perf_counter() - t0
    out = tmp / f"{path.stem}.kiln"
    engine.save(out)
    ctx = kiln.load(out).create_context()
    dev = {i.name: torch.from_numpy(feeds[i.name].astype(i.dtype.np, copy=False)).cuda()
           for i in ctx.engine.inputs}
    info = {"build_s": build_s, "layers": sum(builder.report.get("nodes_after", {}).values()),
            "nodes_after": builder.report.get("nodes_after"),
            "autotune": builder.report.get("autotune_summary"),
            # a fused layer's name can be 1,000 characters: keep its head and the pick
            "log": [ln if len(ln) <= 500 else ln[:120] + " ... " + ln[-380:]
                    for ln in lines if ln.startswith("autotune")]}
    return (lambda: ctx.run(dev, copy_outputs=False)), info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-tune", action="store_true")
    p.add_argument("--peer", action="store_true", help="also torch eager FP16")
    p.add_argument("--precision", choices=("fp16", "int8", "fp8"), default="fp16",
                   help="kiln's engine: FP16, or FP16 with INT8 / FP8 layers calibrated on "
                        "four seeded batches of the corpus feeds (default fp16)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import tempfile

    import torch

    from bench.corpus import manifest

    entry = manifest.load(args.corpus)[args.model]
    feeds = entry.feeds(seed=0, batch=args.batch)
    res: dict = {"model": args.model, "batch": args.batch, "tune": not args.no_tune,
                 "device": torch.cuda.get_device_name()}
    systems = {}
    with tempfile.TemporaryDirectory() as tmp:
        calib = [entry.feeds(seed=s, batch=args.batch) for s in range(1, 5)]
        fn, info = kiln_fn(Path(args.corpus) / entry.file, feeds, not args.no_tune, Path(tmp),
                           args.precision, calib)
        systems[f"kiln {args.precision}"] = (fn, info)
        if args.peer and entry.has_torch_definition:
            from bench.corpus.cuda import torch_system

            systems["torch eager fp16"] = (torch_system(args.model, feeds, entry, False, {}),
                                           {})
        for name, (fn, info) in systems.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            per, b2b = event_ms(fn, args.iters)
            r = dict(info, per_call_ms=per, back_to_back_ms=b2b,
                     items_per_s=args.batch * 1e3 / b2b, **kernel_table(fn, args.iters, args.top))
            res[name] = r
            print(f"== {name}: {args.model} b{args.batch}: per call {per:.3f} ms, back-to-back "
                  f"{b2b:.3f} ms ({r['items_per_s']:.0f}/s), kernel sum {r['kernel_sum_ms']:.3f}"
                  f" ms, {r['kernels_per_call']:.0f} kernels/call"
                  + (f", build {info['build_s']:.1f} s, {info['layers']} layers" if info else ""))
            for ln in info.get("log", []):
                if not ln.startswith("autotune "):  # the engine-wide lines
                    print("  " + ln)
            for k in r["top"]:
                print(f"  {k['ms']:8.3f} ms {100 * k['share']:5.1f}% x{k['calls']:5.1f}  "
                      f"{k['name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
