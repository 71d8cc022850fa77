"""kiln build: ONNX model -> engine file."""

from __future__ import annotations

import time

from kiln.cli.args import (
    add_calibration_args,
    add_common_args,
    add_layer_precision_arg,
    add_precision_args,
    add_shape_args,
    parse_layer_precision,
    profile_from_args,
)
from kiln.cli.progress import Stages, human_bytes

NAME = "build"
HELP = "build an engine file from an ONNX model"


def add_arguments(p):
    p.add_argument("model", help="the ONNX model")
    p.add_argument("-o", "--output", help="engine file to write (default: MODEL.kiln)")
    add_shape_args(p)
    add_precision_args(p)
    add_calibration_args(p)
    add_layer_precision_arg(p)
    p.add_argument("--no-optimize", action="store_true", help="skip the graph optimizer")
    p.add_argument("--timing-cache", help="timing cache file for kernel selection")
    p.add_argument("--no-tune", action="store_true",
                   help="CUDA: skip kernel timing; every layer runs its first (PyTorch) kernel "
                        "(builds in seconds; for accuracy checks, not speed)")
    p.add_argument("--tune-at", choices=("all", "opt"), default="all",
                   help="CUDA: time kernels at the profile's min, opt and max shapes, each run "
                        "taking those of the first point at least as large as its inputs "
                        "(all, the default), or at opt only (TensorRT's way)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="CUDA: processes compiling the Triton candidates before timing "
                        "(default: 3/4 of the host's cores, at most 12, none below 4 cores; "
                        "0: compile in the build process)")
    p.add_argument("--plan-margin", type=float, default=0.25, metavar="F",
                   help="CUDA: keep a kernel embedded in the engine over a faster cuDNN one "
                        "when at most this fraction slower (cuDNN makes a plan per layer "
                        "shape at the first run; default 0.25; 0: always the fastest)")
    p.add_argument("--plan-payback", type=int, default=1000, metavar="RUNS",
                   help="CUDA: keep a faster library kernel (cuBLAS, cuDNN, SDPA) whatever "
                        "--plan-margin says when what it saves per run pays back the library's "
                        "start-up within this many runs (default 1000; 0: the margin alone)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="CUDA: launch kernels one by one instead of replaying CUDA graphs")
    p.add_argument("--no-int8-handoff", action="store_true",
                   help="CUDA: every INT8/FP8 layer quantizes its float input itself, instead "
                        "of the GEMM or LayerNorm before it writing the 8-bit codes (the "
                        "default where only 8-bit layers read a tensor)")
    add_common_args(p)


def _precision_lines(msg: str) -> bool:
    """Without --verbose, the build still says what precision did (INT8 layers kept in
    float and why, calibration, NaN/Inf findings) and notes what the user should know (inputs
    no profile fixes)."""
    return msg.startswith(("int8:", "calibration:", "WARNING", "explicit quantization", "note:"))


def main(args) -> int:
    from kiln.builder import Builder, BuilderConfig

    profile = profile_from_args(args)
    cfg = BuilderConfig(device=args.device, fp16=args.fp16, bf16=args.bf16, int8=args.int8,
                        fp8=args.fp8, tf32=not args.no_tf32, profiles=[profile] if profile else [],
                        low_precision_io=args.low_precision_io,
                        optimize=not args.no_optimize, timing_cache=args.timing_cache,
                        tune=not args.no_tune, tune_at=args.tune_at,
                        compile_workers=args.compile_workers,
                        plan_margin=args.plan_margin, plan_payback=args.plan_payback,
                        cuda_graph=not args.no_cuda_graph,
                        calib=args.calib, calibrator=args.calibrator,
                        calib_cache=args.calib_cache, int8_asymmetric=args.asymmetric,
                        int8_smoothing=args.smooth, qdq_shared_int8=args.qdq_shared_int8,
                        qlinear_conv_int8=args.qlinear_conv_int8,
                        int8_handoff=not args.no_int8_handoff,
                        layer_precision=parse_layer_precision(args.layer_precision),
                        verbose=args.verbose)
    out = args.output or (args.model.rsplit(".", 1)[0] + ".kiln")
    stages = Stages(2)

    def log(msg: str) -> None:
        if args.verbose or _precision_lines(msg):
            stages.line(msg)
    t0 = time.perf_counter()
    builder = Builder(cfg, log=log)
    with stages.stage(f"building {args.model}"):
        engine = builder.build(args.model)
    with stages.stage(f"writing {out}"):
        size = engine.save(out)
    rep = builder.report
    before, after = rep["nodes_before"], rep["nodes_after"]
    print(f"{args.model}: {sum(before.values())} nodes -> {len(engine.graph.nodes)} layers, "
          f"{human_bytes(engine.weight_bytes)} of weights")
    if args.verbose:
        print("nodes per op (before -> after):")
        for op in sorted(set(before) | set(after)):
            print(f"  {op:<28} {before.get(op, 0):>5} -> {after.get(op, 0):>5}")
    if rep.get("near_misses") and not args.verbose:
        print(f"{len(rep['near_misses'])} subgraph(s) a fusion almost matched "
              "(--verbose says which and why)")
    print(f"wrote {out} ({human_bytes(size)}) in {time.perf_counter() - t0:.2f} s")
    return 0
