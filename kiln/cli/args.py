"""Argument groups shared between subcommands, and parsers for their values."""

from __future__ import annotations

import argparse

from kiln.errors import KilnError


def parse_shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """``"input:1x3x224x224,mask:1x128"`` -> ``{"input": (1, 3, 224, 224), "mask": (1, 128)}``."""
    out: dict[str, tuple[int, ...]] = {}
    if not text:
        return out
    for item in text.split(","):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise KilnError(f"bad shape '{item}': write it as name:1x3x224x224")
        try:
            out[name] = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
        except ValueError:
            raise KilnError(f"bad shape '{item}': dims must be integers joined by 'x'") from None
    return out


def add_shape_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shapes")
    g.add_argument("--shapes", help="fixed input shapes, e.g. input:1x3x224x224,mask:1x128")
    g.add_argument("--min-shapes", help="smallest shapes of the optimization profile")
    g.add_argument("--opt-shapes", help="shapes the engine is tuned for")
    g.add_argument("--max-shapes", help="largest shapes of the optimization profile")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision and device")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    g.add_argument("--fp16", action="store_true", help="allow FP16 layers")
    g.add_argument("--bf16", action="store_true", help="allow BF16 layers")
    g.add_argument("--int8", action="store_true", help="allow INT8 layers")
    g.add_argument("--fp8", action="store_true",
                   help="FP8 (e4m3) matrix products, scaled by INT8 calibration (Hopper)")
    g.add_argument("--no-tf32", action="store_true", help="disallow TF32 for FP32 layers")
    g.add_argument("--low-precision-io", action="store_true",
                   help="with --fp16/--bf16: float32 inputs and outputs take that precision "
                        "too (no Casts at the edges; pass and get FP16/BF16 arrays)")


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("INT8 calibration")
    g.add_argument("--calib", metavar="DIR",
                   help="calibration data: a folder of .npz batches (keys: input names) or of "
                        ".npy batches (one-input models), or a Python file defining batches()")
    g.add_argument("--calibrator", choices=["auto", "entropy", "percentile", "minmax"],
                   default="auto", help="how activation ranges are chosen (default: auto, "
                                        "min-max for matrix products' inputs and TensorRT's "
                                        "EntropyCalibrator2 for the rest)")
    sym = g.add_mutually_exclusive_group()
    sym.add_argument("--asymmetric", dest="asymmetric", action="store_true", default=None,
                     help="asymmetric INT8 ranges [min, max] for activations (the default; "
                          "the cache carries zero points, kiln's extension)")
    sym.add_argument("--symmetric", dest="asymmetric", action="store_false",
                     help="symmetric ranges [-amax, amax], as TensorRT's")
    g.add_argument("--smooth", type=float, default=0.5, metavar="ALPHA",
                   help="SmoothQuant's alpha for LayerNorm outputs read by INT8 matrix "
                        "products (default 0.5; 0: off)")
    g.add_argument("--qdq-shared-int8", action="store_true",
                   help="QDQ models: a Q/DQ pair read by weight layers and other ops alike makes "
                        "the weight layers INT8 on its codes too (off by default: faster, but "
                        "not always within 1e-4 of onnxruntime)")
    g.add_argument("--qlinear-conv-int8", action="store_true",
                   help="QOperator models: QLinearConv layers as kiln INT8 convolutions (faster; "
                        "off by default on the CPU: a few output codes in 10,000 differ from "
                        "onnxruntime's by one)")
    g.add_argument("--calib-cache", metavar="FILE",
                   help="calibration cache (TensorRT text format): read when it exists, "
                        "written after calibrating otherwise")


def add_layer_precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layer-precision", metavar="NAME:PREC,...",
                   help="pin layers to a precision (fp32, fp16, bf16, int8), e.g. "
                        "'/encoder/layer.0/output/dense/MatMul:fp32'; a fused layer matches "
                        "by any of its parts")


def parse_layer_precision(text: str | None) -> dict[str, str]:
    """``"a:fp32,b:fp16"`` -> ``{"a": "fp32", "b": "fp16"}`` (names may hold ':')."""
    from kiln.builder.config import PRECISIONS

    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, prec = item.strip().rpartition(":")
        if not sep or not name or prec not in PRECISIONS:
            raise KilnError(f"bad --layer-precision item '{item}': write NAME:PRECISION with "
                            f"PRECISION one of {', '.join(PRECISIONS)}")
        out[name] = prec
    return out


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every step, and Python tracebacks on errors")


def profile_from_args(args):
    """The optimization profile the shape flags describe, or None."""
    from kiln.engine.profile import Profile

    fixed = parse_shapes(args.shapes)
    lo, opt, hi = (parse_shapes(getattr(args, k)) for k in ("min_shapes", "opt_shapes",
                                                            "max_shapes"))
    if not (fixed or lo or opt or hi):
        return None
    if fixed and (lo or opt or hi):
        raise KilnError("give either --shapes or --min/--opt/--max-shapes, not both")
    if fixed:
        return Profile.fixed(fixed)
    names = set(lo) | set(opt) | set(hi)
    for n in names:
        got = [k for k, d in (("min", lo), ("opt", opt), ("max", hi)) if n in d]
        if len(got) != 3:
            raise KilnError(f"input '{n}' needs --min-shapes, --opt-shapes and --max-shapes "
                            f"(got only {', '.join(got)})")
    return Profile(lo, opt, hi)
