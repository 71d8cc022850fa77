"""Shape/dtype rules shared by many OpDefs. A rule takes an InferCtx and returns output types."""

from __future__ import annotations

import sympy

from kiln.ir.dtype import DType
from kiln.ir.opdef import InferCtx
from kiln.ir.types import TensorType, as_dim


def tensor(dtype, shape):
    return TensorType(dtype, None if shape is None else tuple(as_dim(d) for d in shape))


def broadcast_shapes(*shapes):
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        known = [d for d in dims if d is not None and d != 1]
        if not known:
            out.append(None if None in dims else 1)
        else:  # a fixed size wins over an expression (no str() of sympy dims: milliseconds each)
            out.append(next((d for d in known if isinstance(d, int)), known[0]))
    return tuple(out)


def broadcast_ints(*shapes) -> tuple:
    """The NumPy broadcast of concrete shapes (ints), as ``torch.broadcast_shapes`` gives it,
    which kernels do not call: its first call imports torch's symbolic-shape machinery (about
    0.2 s, paid by an engine's first run). Raises ValueError for shapes that do not
    broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate(s, rank - len(s)):
            d = int(d)
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[i] = d
    return tuple(out)


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def same(i: int = 0):
    def rule(ctx: InferCtx):
        return [ctx.type(i)] * max(ctx.n_out, 1)
    return rule


def same_shape(dtype: DType):
    def rule(ctx: InferCtx):
        return [tensor(dtype, ctx.shape(0))]
    return rule


def broadcast(dtype: DType | None = None):
    """Elementwise ops over broadcast inputs; result dtype is the first input's or ``dtype``."""
    def rule(ctx: InferCtx):
        shapes = [ctx.shape(i) for i in range(len(ctx.in_types)) if ctx.has(i)]
        return [tensor(dtype or ctx.dtype(0), broadcast_shapes(*shapes))]
    return rule


def reduce_shape(shape, axes, keepdims: bool):
    if shape is None or axes is None:
        return None
    r = len(shape)
    axes = {norm_axis(a, r) for a in axes} if len(axes) else set(range(r))
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def prod(dims):
    out = 1
    for d in dims:
        if d is None:
            return None
        out = out * d
    return as_dim(out) if isinstance(out, sympy.Expr) else out
