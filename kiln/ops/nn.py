"""Neural-network core ops: convolutions, pooling, normalizations, softmax family, matmul.

The window geometry helpers here (``window_geometry``) are shared by the shape rules and the
kernels, so a node's inferred shape and its computed shape cannot disagree. They accept ints and
sympy dims alike.
"""

from __future__ import annotations

import sympy

from kiln.ir import DType
from kiln.ops.rules import broadcast_shapes, norm_axis, same, tensor
from kiln.ops.schema import onnx_op

# ---------------------------------------------------------------- window geometry


def _div(a, s: int, ceil: bool = False):
    """floor(a / s) (or ceil) for an int or a sympy dim."""
    if a is None:
        return None
    if isinstance(a, int):
        return -(-a // s) if ceil else a // s
    if s == 1:
        return a
    return (sympy.ceiling if ceil else sympy.floor)(a / s)


def _max0(a):
    return max(a, 0) if isinstance(a, int) else sympy.Max(a, 0)


def spatial_attrs(a, n_sp: int, kernel=None):
    """kernel, strides, dilations, pads (begin..., end...) of a windowed op, with defaults."""
    kernel = list(a.kernel_shape or kernel or ())
    strides = list(a.strides or [1] * n_sp)
    dil = list(getattr(a, "dilations", None) or [1] * n_sp)
    pads = list(a.pads or [0] * (2 * n_sp))
    return kernel, strides, dil, pads


def window_geometry(in_sp, kernel, strides, dil, pads, auto_pad="NOTSET", ceil_mode=False):
    """Output sizes and the (begin, end) pads actually applied, per spatial dim.

    Follows ONNX (= PyTorch) semantics: SAME_* gives ceil(in / stride) outputs with the odd pad
    at the end (UPPER) or the beginning (LOWER); in ceil mode a last window that would start in
    the end padding is dropped.
    """
    auto_pad = auto_pad or "NOTSET"
    n = len(in_sp)
    outs, begin, end = [], [], []
    for i in range(n):
        x, k, s, d = in_sp[i], kernel[i], strides[i], dil[i]
        dk = (k - 1) * d + 1
        if x is None:
            outs.append(None)
            begin.append(None)
            end.append(None)
            continue
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = _div(x, s, ceil=True)
            total = _max0((o - 1) * s + dk - x)
            small = _div(total, 2)
            pb, pe = (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)
        elif auto_pad == "VALID":
            o, pb, pe = _div(x - dk + 1, s, ceil=True), 0, 0
        else:
            pb, pe = pads[i], pads[i + n]
            # floor(a / s) + 1 == ceil((a + 1) / s); the latter reads better symbolically
            span = x + pb + pe - dk
            o = _div(span, s, ceil=True) + 1 if ceil_mode else _div(span + 1, s, ceil=True)
            if ceil_mode and isinstance(o, int) and (o - 1) * s >= x + pb:
                o -= 1
        outs.append(o)
        begin.append(pb)
        end.append(pe)
    return outs, begin, end


# ---------------------------------------------------------------- shape rules


def _conv_rule(ctx):
    x, w = ctx.shape(0), ctx.shape(1)
    if x is None:
        return [tensor(ctx.dtype(0), None)]
    n_sp = len(x) - 2
    kernel = ctx.attrs.kernel_shape or (w[2:] if w is not None else None)
    m = w[0] if w is not None else None
    if kernel is None or any(k is None or not isinstance(k, int) for k in kernel):
        return [tensor(ctx.dtype(0), (x[0], m) + (None,) * n_sp)]
    k, s, d, p = spatial_attrs(ctx.attrs, n_sp, kernel)
    outs, _, _ = window_geometry(x[2:], k, s, d, p, ctx.attrs.auto_pad)
    return [tensor(ctx.dtype(0), (x[0], m, *outs))]


def convtranspose_geometry(in_sp, a, kernel):
    """Output sizes and (begin, end) pads of ConvTranspose (pads may be negative: zero fill)."""
    n = len(in_sp)
    _, s, d, p = spatial_attrs(a, n, kernel)
    op = list(a.output_padding or [0] * n)
    full = [None if x is None else s[i] * (x - 1) + op[i] + (kernel[i] - 1) * d[i] + 1
            for i, x in enumerate(in_sp)]
    auto = a.auto_pad or "NOTSET"
    if a.output_shape or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = list(a.output_shape or [None if x is None else x * s[i]
                                         for i, x in enumerate(in_sp)])
        target = target[-n:]
        begin, end = [], []
        for f, t in zip(full, target):
            total = None if f is None else f - t
            small = None if total is None else _div(total, 2)
            if total is None:
                begin.append(None)
                end.append(None)
            elif auto == "SAME_UPPER":
                begin.append(small)
                end.append(total - small)
            else:
                begin.append(total - small)
                end.append(small)
        return target, begin, end
    outs = [None if f is None else f - p[i] - p[i + n] for i, f in enumerate(full)]
    return outs, p[:n], p[n:]


def _convtranspose_rule(ctx):
    x, w = ctx.shape(0), ctx.shape(1)
    if x is None:
        return [tensor(ctx.dtype(0), None)]
    n_sp = len(x) - 2
    kernel = ctx.attrs.kernel_shape or (w[2:] if w is not None else None)
    m = None if w is None or w[1] is None else w[1] * (ctx.attrs.group or 1)
    if kernel is None or not all(isinstance(k, int) for k in kernel):
        return [tensor(ctx.dtype(0), (x[0], m) + (None,) * n_sp)]
    outs, _, _ = convtranspose_geometry(x[2:], ctx.attrs, list(kernel))
    return [tensor(ctx.dtype(0), (x[0], m, *outs))]


def _pool_rule(ctx):
    x = ctx.shape(0)
    if x is None:
        return [tensor(ctx.dtype(0), None)] * max(ctx.n_out, 1)
    n_sp = len(x) - 2
    k, s, d, p = spatial_attrs(ctx.attrs, n_sp)
    outs, _, _ = window_geometry(x[2:], k, s, d, p, ctx.attrs.auto_pad,
                                 getattr(ctx.attrs, "ceil_mode", 0))
    shape = (x[0], x[1], *outs)
    return [tensor(ctx.dtype(0), shape), tensor(DType.int64, shape)][:max(ctx.n_out, 1)]


def _global_pool_rule(ctx):
    x = ctx.shape(0)
    shape = None if x is None else (*x[:2], *([1] * (len(x) - 2)))
    return [tensor(ctx.dtype(0), shape)]


def _batchnorm_rule(ctx):
    c = None if ctx.shape(0) is None or len(ctx.shape(0)) < 2 else ctx.shape(0)[1]
    stat = tensor(ctx.dtype(3) or ctx.dtype(0), (c,))
    return [ctx.type(0)] + [stat] * (max(ctx.n_out, 1) - 1)


def stash_dtype(a, x_dtype):
    """The dtype LayerNormalization-style ops compute (and stash Mean/InvStdDev) in."""
    st = getattr(a, "stash_type", 1)
    return DType(st) if st not in (None, 0) else x_dtype


def _layernorm_rule(ctx):
    x = ctx.shape(0)
    out = [ctx.type(0)]
    if ctx.n_out > 1:
        if x is None:
            stat = None
        else:
            ax = norm_axis(ctx.attrs.axis, len(x))
            stat = (*x[:ax], *([1] * (len(x) - ax)))
        st = tensor(stash_dtype(ctx.attrs, ctx.dtype(0)), stat)
        out += [st] * (ctx.n_out - 1)
    return out


def _matmul_rule(ctx):
    a, b = ctx.shape(0), ctx.shape(1)
    if a is None or b is None or len(a) == 0 or len(b) == 0:
        return [tensor(ctx.dtype(0), None)]
    a1, b1 = len(a) == 1, len(b) == 1
    a2 = (1, a[0]) if a1 else a
    b2 = (b[0], 1) if b1 else b
    batch = broadcast_shapes(a2[:-2], b2[:-2])
    shape = (*batch, *(() if a1 else (a2[-2],)), *(() if b1 else (b2[-1],)))
    return [tensor(ctx.dtype(0), shape)]


def _gemm_rule(ctx):
    a, b = ctx.shape(0), ctx.shape(1)
    m = None if a is None else a[1 if ctx.attrs.transA else 0]
    n = None if b is None else b[0 if ctx.attrs.transB else 1]
    return [tensor(ctx.dtype(0), (m, n))]


def _det_rule(ctx):
    x = ctx.shape(0)
    return [tensor(ctx.dtype(0), None if x is None else x[:-2])]


# ---------------------------------------------------------------- OpDefs

Conv = onnx_op("Conv", _conv_rule)
ConvTranspose = onnx_op("ConvTranspose", _convtranspose_rule)
DeformConv = onnx_op("DeformConv", None)
AveragePool = onnx_op("AveragePool", _pool_rule)
MaxPool = onnx_op("MaxPool", _pool_rule)
LpPool = onnx_op("LpPool", _pool_rule)
GlobalAveragePool = onnx_op("GlobalAveragePool", _global_pool_rule)
GlobalMaxPool = onnx_op("GlobalMaxPool", _global_pool_rule)
GlobalLpPool = onnx_op("GlobalLpPool", _global_pool_rule)
MaxUnpool = onnx_op("MaxUnpool", None)
BatchNormalization = onnx_op("BatchNormalization", _batchnorm_rule)
InstanceNormalization = onnx_op("InstanceNormalization", same())
LayerNormalization = onnx_op("LayerNormalization", _layernorm_rule)
GroupNormalization = onnx_op("GroupNormalization", same())
RMSNormalization = onnx_op("RMSNormalization", same())
LRN = onnx_op("LRN", same())
LpNormalization = onnx_op("LpNormalization", same())
MeanVarianceNormalization = onnx_op("MeanVarianceNormalization", same())
Softmax = onnx_op("Softmax", same())
LogSoftmax = onnx_op("LogSoftmax", same())
Hardmax = onnx_op("Hardmax", same())
MatMul = onnx_op("MatMul", _matmul_rule)
Gemm = onnx_op("Gemm", _gemm_rule)
Einsum = onnx_op("Einsum", None)
Det = onnx_op("Det", _det_rule)
Col2Im = onnx_op("Col2Im", None)
