"""Casts and quantization: Cast, CastLike, BitCast, (De)QuantizeLinear, integer/QLinear ops."""

from __future__ import annotations

import onnx
import sympy

from kiln.ir import REGISTRY, DType
from kiln.ir.opdef import Attr, InferCtx, OpDef
from kiln.ops.rules import broadcast_shapes, tensor
from kiln.ops.schema import onnx_op


def cast_target(to) -> DType:
    """The ``to`` attribute: an ONNX type code, or a type name in Cast-1 models."""
    if isinstance(to, str):
        return DType.from_onnx(onnx.TensorProto.DataType.Value(to.upper()))
    return DType.from_onnx(int(to))


def _cast(ctx: InferCtx):
    to = cast_target(ctx.attrs.to)
    # a Cast of a shape vector (e.g. Shape -> Cast(int32)) keeps its symbolic contents
    ctx.out_syms = [ctx.sym(0) if to.is_int else None]
    return [tensor(to, ctx.shape(0))]


def _cast_like(ctx: InferCtx):
    to = ctx.dtype(1)
    ctx.out_syms = [ctx.sym(0) if to is not None and to.is_int else None]
    return [tensor(to, ctx.shape(0))]


def _bitcast(ctx: InferCtx):
    return [tensor(cast_target(ctx.attrs.to), ctx.shape(0))]


def quant_dtype(attrs, zero_point_dtype) -> DType:
    """The QuantizeLinear result type: the zero point's, else ``output_dtype``, else uint8."""
    if zero_point_dtype is not None:
        return zero_point_dtype
    if getattr(attrs, "output_dtype", None):
        return DType.from_onnx(attrs.output_dtype)
    return DType.uint8


def _quantize(ctx: InferCtx):
    return [tensor(quant_dtype(ctx.attrs, ctx.dtype(2) if ctx.has(2) else None), ctx.shape(0))]


def _dequantize(ctx: InferCtx):
    od = getattr(ctx.attrs, "output_dtype", None)
    return [tensor(DType.from_onnx(od) if od else ctx.dtype(1), ctx.shape(0))]


def _dynamic_quantize(ctx: InferCtx):
    return [tensor(DType.uint8, ctx.shape(0)), tensor(ctx.dtype(0), ()), tensor(DType.uint8, ())]


def matmul_shape(a, b):
    """numpy matmul shape rule, with 1-D operands promoted and the added dim dropped again."""
    if a is None or b is None or not a or not b:
        return None
    a2 = (1,) + tuple(a) if len(a) == 1 else tuple(a)
    b2 = tuple(b) + (1,) if len(b) == 1 else tuple(b)
    batch = broadcast_shapes(a2[:-2], b2[:-2])
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _matmul_integer(ctx: InferCtx):
    return [tensor(DType.int32, matmul_shape(ctx.shape(0), ctx.shape(1)))]


def _qlinear_matmul(ctx: InferCtx):
    dt = ctx.dtype(7) if ctx.has(7) else ctx.dtype(0)
    return [tensor(dt, matmul_shape(ctx.shape(0), ctx.shape(3)))]


def _qgemm(ctx: InferCtx):
    """com.microsoft QGemm: [M, N] codes of y_zero_point's type, or float32 without it."""
    a, b = ctx.shape(0), ctx.shape(3)
    m = None if a is None else a[1 if ctx.attrs.transA else 0]
    n = None if b is None else b[0 if ctx.attrs.transB else 1]
    dt = ctx.dtype(8) if ctx.has(8) else DType.float32
    return [tensor(dt, (m, n))]


def _out_dim(size, k, stride, dil, pad_total, auto_pad: str):
    if size is None:
        return None
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return -((-size) // stride) if isinstance(size, int) else sympy.ceiling(size / stride)
    span = size + pad_total - dil * (k - 1) - 1
    return span // stride + 1 if isinstance(span, int) else sympy.floor(span / stride) + 1


def conv_shape(x, w, attrs):
    """Output shape of an N-d convolution (NCHW data, OIHW weights); symbolic spatial dims."""
    if x is None or w is None or len(x) < 3:
        return None
    n_sp = len(x) - 2
    ks = tuple(attrs.kernel_shape or ()) or tuple(w[2:])
    if any(not isinstance(k, int) for k in ks):
        return None
    strides = tuple(attrs.strides or ()) or (1,) * n_sp
    dils = tuple(attrs.dilations or ()) or (1,) * n_sp
    pads = tuple(attrs.pads or ()) or (0,) * (2 * n_sp)
    auto_pad = attrs.auto_pad or "NOTSET"
    sp = [_out_dim(x[2 + i], ks[i], strides[i], dils[i], pads[i] + pads[i + n_sp], auto_pad)
          for i in range(n_sp)]
    return (x[0], w[0], *sp)


def _conv_integer(ctx: InferCtx):
    return [tensor(DType.int32, conv_shape(ctx.shape(0), ctx.shape(1), ctx.attrs))]


def _qlinear_conv(ctx: InferCtx):
    dt = ctx.dtype(7) if ctx.has(7) else ctx.dtype(0)
    return [tensor(dt, conv_shape(ctx.shape(0), ctx.shape(3), ctx.attrs))]


Cast = onnx_op("Cast", _cast)
CastLike = onnx_op("CastLike", _cast_like)
BitCast = onnx_op("BitCast", _bitcast)
QuantizeLinear = onnx_op("QuantizeLinear", _quantize)
DequantizeLinear = onnx_op("DequantizeLinear", _dequantize)
DynamicQuantizeLinear = onnx_op("DynamicQuantizeLinear", _dynamic_quantize)
MatMulInteger = onnx_op("MatMulInteger", _matmul_integer)
QLinearMatMul = onnx_op("QLinearMatMul", _qlinear_matmul)
ConvInteger = onnx_op("ConvInteger", _conv_integer)
QLinearConv = onnx_op("QLinearConv", _qlinear_conv)

# onnxruntime's contrib op, what its quantize_static writes for a Gemm in QOperator format
QGemm = REGISTRY.add(OpDef(
    "QGemm", {"alpha": Attr("float", 1.0), "transA": Attr("int", 0), "transB": Attr("int", 0)},
    domain="com.microsoft", infer=_qgemm, versions=(1,),
    doc="Gemm of 8-bit codes (onnxruntime): (C + (A - a_zero) @ (B - b_zero)) * alpha * "
        "a_scale * b_scale [/ y_scale, + y_zero, saturated]; inputs A, a_scale, a_zero_point, "
        "B, b_scale, b_zero_point, C (int32), y_scale, y_zero_point"))
