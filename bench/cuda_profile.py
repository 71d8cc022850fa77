"""Where a kiln CUDA engine's time goes, kernel by kernel, beside torch eager on the same module.

    python -m bench.cuda_profile --corpus DIR --model tv_resnet50_op17 --batch 256 [--no-tune]
        [--peer] [--precision fp16,int8,fp8] [--no-handoff] [--iters 20] [--json OUT]

Builds kiln FP16 (fixed profile at the batch, FP16 I/O, tuned unless ``--no-tune``; a timing
cache beside the engine), times it per call and back-to-back (CUDA events), then records
``--iters`` calls under ``torch.profiler`` and prints the kernels by total device time: name,
calls per inference, ms per inference, share. ``kernel sum`` against the back-to-back time says
how much of a call is device work and how much is gaps between kernels (host overhead).
``--peer`` does the same for the model's torch definition in eager FP16 (cuDNN/cuBLAS), the
kernel mix a fast engine should at least match.

``--precision`` takes a comma-separated list (``fp16,int8,fp8``): each engine is built and
timed in turn (INT8/FP8 calibrated on four seeded batches of the corpus feeds, apart from the
timed and held-out ones), and the run ends with each one's throughput against the FP16
engine's (``ratio int8/fp16 1.42x``, back-to-back and per call) and its agreement with an
FP32 engine on two held-out batches: mean cosine of the outputs and, for a [batch, classes]
output, top-1 agreement. The build log's quantization and hand-off lines are printed too.
``--no-handoff``: INT8/FP8 layers quantize their own float inputs (BuilderConfig.int8_handoff
off), the A/B of the fused form.
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
            calib: list | None = None, handoff: bool = True):
    import torch

    import kiln

    cache = tmp / f"{path.stem}.cache"
    low = {"int8": dict(int8=True, calib=calib), "fp8": dict(fp8=True, calib=calib)}
    prof = [kiln.Profile.fixed({k: v.shape for k, v in feeds.items()})]
    if precision == "fp32":
        cfg = kiln.BuilderConfig(device="cuda", tune=False, profiles=prof)
    else:
        cfg = kiln.BuilderConfig(device="cuda", fp16=True, low_precision_io=True, tune=tune,
                                 timing_cache=str(cache), int8_handoff=handoff,
                                 **low.get(precision, {}), profiles=prof)
    t0 = time.perf_counter()
    lines: list[str] = []
    builder = kiln.Builder(cfg, log=lines.append)
    engine = builder.build(str(path))
    build_s = time.perf_counter() - t0
    out = tmp / f"{path.stem}.{precision}.kiln"
    engine.save(out)
    ctx = kiln.load(out).create_context()
    dev = {i.name: torch.from_numpy(feeds[i.name].astype(i.dtype.np, copy=False)).cuda()
           for i in ctx.engine.inputs}
    q8 = ("int8:", "calibration:")  # the quantization and hand-off lines
    info = {"build_s": build_s, "layers": sum(builder.report.get("nodes_after", {}).values()),
            "nodes_after": builder.report.get("nodes_after"),
            "autotune": builder.report.get("autotune_summary"),
            "handoffs": (builder.report.get("int8") or {}).get("handoffs"),
            # a fused layer's name can be 1,000 characters: keep its head and the pick
            "log": [ln if len(ln) <= 500 else ln[:120] + " ... " + ln[-380:]
                    for ln in lines if ln.startswith("autotune") or (
                        ln.startswith(q8) and "kept in float" not in ln)],
            "picks": _picks(builder.report.get("autotune") or {})}

    def outputs(batch: dict) -> list:
        """The engine's outputs (float32 numpy, in order) on a batch of host feeds."""
        d = {i.name: torch.from_numpy(batch[i.name].astype(i.dtype.np, copy=False)).cuda()
             for i in ctx.engine.inputs}
        return [v.float().cpu().numpy() for v in ctx.run(d, copy_outputs=False).values()]

    return (lambda: ctx.run(dev, copy_outputs=False)), info, outputs


def _picks(selections: dict) -> dict:
    """How many layers took each kernel (the INT8 layers' 8-bit vs FP16 tactics)."""
    count: dict = defaultdict(int)
    for sel in selections.values():
        count[sel.get("kernel", "?") if isinstance(sel, dict) else getattr(sel, "kernel", "?")] \
            += 1
    return dict(sorted(count.items(), key=lambda kv: -kv[1]))


def agreement(got: list, ref: list) -> dict:
    """Mean cosine of the first outputs (per sample) to the reference's, and top-1 agreement
    where that output is [batch, classes]."""
    import numpy as np

    cos, top1 = [], []
    for g, r in zip(got, ref):
        g, r = g.reshape(len(g), -1).astype(np.float64), r.reshape(len(r), -1).astype(
            np.float64)
        cos += list((g * r).sum(1) / np.maximum(
            np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1), 1e-30))
        if g.shape[1] > 1 and g.shape == r.shape:
            top1 += list(g.argmax(1) == r.argmax(1))
    out = {"cosine": float(np.mean(cos))}
    if top1:
        out["top1_agreement"] = float(np.mean(top1))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-tune", action="store_true")
    p.add_argument("--peer", action="store_true", help="also torch eager FP16")
    p.add_argument("--precision", default="fp16",
                   help="kiln's engines, comma-separated: fp16, int8, fp8 (FP16 with INT8 / "
                        "FP8 layers calibrated on four seeded batches of the corpus feeds); "
                        "with more than one, ratios to fp16 and agreement with FP32 at the "
                        "end (default fp16)")
    p.add_argument("--no-handoff", action="store_true",
                   help="INT8/FP8 layers quantize their float inputs themselves")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    bad = [x for x in precisions if x not in ("fp16", "int8", "fp8")]
    if bad or not precisions:
        p.error(f"--precision takes fp16, int8, fp8 (comma-separated), not {args.precision!r}")

    import tempfile

    import torch

    from bench.corpus import manifest

    entry = manifest.load(args.corpus)[args.model]
    feeds = entry.feeds(seed=0, batch=args.batch)
    res: dict = {"model": args.model, "batch": args.batch, "tune": not args.no_tune,
                 "device": torch.cuda.get_device_name()}
    outs: dict = {}
    path = Path(args.corpus) / entry.file
    held = [entry.feeds(seed=s, batch=args.batch) for s in (11, 12)]

    def measure(name, fn, info):
        """Time ``fn`` and print its row now (a run cut off keeps what it printed)."""
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
              + (f", build {info['build_s']:.1f} s, {info['layers']} layers" if info else ""),
              flush=True)
        for ln in info.get("log", []):
            if not ln.startswith("autotune "):  # the engine-wide lines
                print("  " + ln)
        if info.get("picks"):
            print("  kernels picked: " + ", ".join(f"{k} x{v}" for k, v in info["picks"].items()))
        for k in r["top"]:
            print(f"  {k['ms']:8.3f} ms {100 * k['share']:5.1f}% x{k['calls']:5.1f}  "
                  f"{k['name']}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        calib = [entry.feeds(seed=s, batch=args.batch) for s in range(1, 5)]
        for prec in precisions:
            try:
                fn, info, run = kiln_fn(path, feeds, not args.no_tune, Path(tmp), prec, calib,
                                        handoff=not args.no_handoff)
            except Exception as e:  # one precision failing must not hide the others
                print(f"== kiln {prec}: build failed: {type(e).__name__}: {str(e)[:300]}")
                res[f"kiln {prec}"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                continue
            measure(f"kiln {prec}", fn, info)
            base = res.get("kiln fp16", {})
            if prec != "fp16" and "back_to_back_ms" in base:  # now, in case the run is cut off
                print(f"  ratio {prec}/fp16 "
                      f"{base['back_to_back_ms'] / res[f'kiln {prec}']['back_to_back_ms']:.2f}x "
                      "back-to-back", flush=True)
            if len(precisions) > 1:
                outs[prec] = [run(b) for b in held]
        if len(precisions) > 1 and outs:
            try:
                run32 = kiln_fn(path, feeds, False, Path(tmp), "fp32")[2]
                outs["fp32"] = [run32(b) for b in held]
            except Exception as e:
                print(f"== kiln fp32 (the accuracy reference): failed: {type(e).__name__}: "
                      f"{str(e)[:300]}")
        if args.peer and entry.has_torch_definition:
            from bench.corpus.cuda import torch_system

            measure("torch eager fp16", torch_system(args.model, feeds, entry, False, {}), {})
        base = res.get("kiln fp16", {})
        for prec in precisions:
            r = res.get(f"kiln {prec}", {})
            line = f"== {args.model} b{args.batch} kiln {prec}:"
            if "back_to_back_ms" not in r:
                print(line + " no result")
                continue
            if "back_to_back_ms" in base:
                r["ratio_to_fp16"] = base["back_to_back_ms"] / r["back_to_back_ms"]
                r["ratio_to_fp16_per_call"] = base["per_call_ms"] / r["per_call_ms"]
                line += (f" ratio {prec}/fp16 {r['ratio_to_fp16']:.2f}x back-to-back, "
                         f"{r['ratio_to_fp16_per_call']:.2f}x per call")
            line += f", {r['items_per_s']:.0f}/s"
            if prec in outs and "fp32" in outs:
                r["vs_fp32"] = agreement(outs[prec], outs["fp32"])
                line += f", vs FP32 on held-out: cosine {r['vs_fp32']['cosine']:.5f}"
                if "top1_agreement" in r["vs_fp32"]:
                    line += f", top-1 agreement {100 * r['vs_fp32']['top1_agreement']:.2f}%"
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
