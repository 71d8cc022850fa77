"""Vision and geometry: resampling (Resize, Upsample, GridSample, AffineGrid), RoiAlign, NMS."""

from __future__ import annotations

import math

import sympy

from kiln.ir.opdef import InferCtx
from kiln.ops.rules import tensor
from kiln.ops.schema import onnx_op


def _scaled_dim(d, s: float):
    """floor(d * s), kept symbolic when that is exact."""
    if d is None:
        return None
    if s == 1.0:
        return d
    if isinstance(d, int):
        return math.floor(d * s)
    if float(s).is_integer():
        return d * int(s)
    return sympy.floor(d * sympy.Rational(s).limit_denominator(1 << 24))


def resize_out_shape(shape, axes, scales=None, sizes=None, policy="stretch"):
    """Output shape of Resize from its input shape and constant scales or sizes."""
    if shape is None:
        return None
    r = len(shape)
    axes = [a + r if a < 0 else a for a in (axes or range(r))]
    out = list(shape)
    if sizes is not None:
        if len(sizes) != len(axes):
            return None
        if policy in ("not_larger", "not_smaller"):
            if any(not isinstance(shape[a], int) for a in axes):
                return [d if i not in axes else None for i, d in enumerate(shape)]
            ratios = [sz / shape[a] for a, sz in zip(axes, sizes)]
            s = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                out[a] = int(s * shape[a] + 0.5)
            return out
        for a, sz in zip(axes, sizes):
            out[a] = sz
        return out
    if scales is None or len(scales) != len(axes):
        return None
    for a, s in zip(axes, scales):
        out[a] = _scaled_dim(shape[a], float(s))
    return out


def _resize_rule(ctx: InferCtx):
    a = ctx.attrs
    n_in = len(ctx.in_types)
    if n_in == 2:  # opset 10: (X, scales)
        scales_i, sizes_i = 1, None
    else:
        scales_i, sizes_i = 2, 3
    sizes = ctx.sym(sizes_i) if sizes_i is not None and ctx.has(sizes_i) else None
    if sizes is not None and len(sizes) == 0:
        sizes = None
    scales = None
    if sizes is None and ctx.has(scales_i) and ctx.value(scales_i) is not None:
        scales = [float(v) for v in ctx.value(scales_i).reshape(-1)]
        if not scales:
            return [tensor(ctx.dtype(0), None)]
    shape = resize_out_shape(ctx.shape(0), a.axes, scales, sizes, a.keep_aspect_ratio_policy)
    return [tensor(ctx.dtype(0), shape)]


def _upsample_rule(ctx: InferCtx):
    a = ctx.attrs
    shape = ctx.shape(0)
    if len(ctx.in_types) > 1 and ctx.has(1):
        v = ctx.value(1)
        scales = None if v is None else [float(s) for s in v.reshape(-1)]
    elif a.scales is not None:
        scales = list(a.scales)
    elif a.height_scale is not None and shape is not None:
        scales = [1.0] * (len(shape) - 2) + [a.height_scale, a.width_scale]
    else:
        scales = None
    return [tensor(ctx.dtype(0), resize_out_shape(shape, None, scales))]


Resize = onnx_op("Resize", _resize_rule)
Upsample = onnx_op("Upsample", _upsample_rule)
GridSample = onnx_op("GridSample", None)
AffineGrid = onnx_op("AffineGrid", None)
RoiAlign = onnx_op("RoiAlign", None)
NonMaxSuppression = onnx_op("NonMaxSuppression", None)
