"""Reductions (ReduceSum & co.) and the classification losses built on them."""

from __future__ import annotations

from kiln.ir.opdef import InferCtx
from kiln.ops.rules import reduce_shape, tensor
from kiln.ops.schema import onnx_op


def reduce_axes(ctx: InferCtx):
    """The node's axes as a tuple, () for "none given", or None when only known at run time.

    ``axes`` is an attribute in old opsets and input 1 in new ones; either may be absent."""
    if ctx.has(1):
        axes = ctx.sym(1)
        if axes is None or any(not isinstance(a, int) for a in axes):
            return None
        return tuple(axes)
    return tuple(ctx.attrs.axes or ())


def reduce_rule(ctx: InferCtx):
    shape, keep = ctx.shape(0), bool(ctx.attrs.keepdims)
    axes = reduce_axes(ctx)
    noop = bool(getattr(ctx.attrs, "noop_with_empty_axes", 0))
    if axes == () and noop:
        return [tensor(ctx.dtype(0), shape)]
    if axes is None:
        # the axes are data: with keepdims the rank survives, the dims do not
        out = None if shape is None or not keep else (None,) * len(shape)
        return [tensor(ctx.dtype(0), out)]
    return [tensor(ctx.dtype(0), reduce_shape(shape, axes, keep))]


ReduceMax = onnx_op("ReduceMax", reduce_rule)
ReduceMin = onnx_op("ReduceMin", reduce_rule)
ReduceSum = onnx_op("ReduceSum", reduce_rule)
ReduceMean = onnx_op("ReduceMean", reduce_rule)
ReduceProd = onnx_op("ReduceProd", reduce_rule)
ReduceL1 = onnx_op("ReduceL1", reduce_rule)
ReduceL2 = onnx_op("ReduceL2", reduce_rule)
ReduceLogSum = onnx_op("ReduceLogSum", reduce_rule)
ReduceLogSumExp = onnx_op("ReduceLogSumExp", reduce_rule)
ReduceSumSquare = onnx_op("ReduceSumSquare", reduce_rule)

REDUCE_OPS = (ReduceMax, ReduceMin, ReduceSum, ReduceMean, ReduceProd, ReduceL1, ReduceL2,
              ReduceLogSum, ReduceLogSumExp, ReduceSumSquare)


def _loss_shape(ctx: InferCtx):
    """(N, C, d1..dk) scores -> (N, d1..dk) per-element loss, or a scalar when reduced."""
    if ctx.attrs.reduction != "none":
        return ()
    shape = ctx.shape(0)
    if shape is None:
        return ctx.shape(1)
    return (shape[0],) + tuple(shape[2:])


def nll_rule(ctx: InferCtx):
    return [tensor(ctx.dtype(0), _loss_shape(ctx))]


def sce_rule(ctx: InferCtx):
    out = [tensor(ctx.dtype(0), _loss_shape(ctx))]
    if ctx.n_out > 1:
        out.append(tensor(ctx.dtype(0), ctx.shape(0)))
    return out


NegativeLogLikelihoodLoss = onnx_op("NegativeLogLikelihoodLoss", nll_rule)
SoftmaxCrossEntropyLoss = onnx_op("SoftmaxCrossEntropyLoss", sce_rule)
