"""Random number generators. ``dtype`` attributes hold ONNX element type numbers."""

from kiln.ir import DType, InferCtx
from kiln.ops.rules import tensor
from kiln.ops.schema import onnx_op


def _dtype(code, fallback):
    return DType(code) if code else fallback


def _from_attrs(ctx: InferCtx):
    return [tensor(_dtype(ctx.attrs.dtype, DType.float32), ctx.attrs.shape)]


def _like(ctx: InferCtx):
    return [tensor(_dtype(ctx.attrs.dtype, ctx.dtype(0)), ctx.shape(0))]


def _multinomial(ctx: InferCtx):
    shape = ctx.shape(0)
    batch = shape[0] if shape is not None and len(shape) == 2 else None
    return [tensor(_dtype(ctx.attrs.dtype, DType.int32), (batch, ctx.attrs.sample_size))]


RandomUniform = onnx_op("RandomUniform", _from_attrs)
RandomNormal = onnx_op("RandomNormal", _from_attrs)
RandomUniformLike = onnx_op("RandomUniformLike", _like)
RandomNormalLike = onnx_op("RandomNormalLike", _like)
Bernoulli = onnx_op("Bernoulli", _like)
Multinomial = onnx_op("Multinomial", _multinomial)
