"""Tensor manipulation and shape ops: the shape subgraphs of exported models live here.

Rules keep dims symbolic (sympy) where they can, and publish ``ctx.out_syms`` for small int
vectors (Shape -> Gather -> Unsqueeze -> Concat -> Reshape) so that Reshape/Expand downstream
see symbolic target shapes instead of unknowns.
"""

from __future__ import annotations

import math

import numpy as np
import sympy

from kiln.ir import DType, InferCtx
from kiln.ir.types import as_dim
from kiln.ops.rules import broadcast_shapes, norm_axis, prod, same, tensor
from kiln.ops.schema import onnx_op

_BIG = 1 << 30  # slice bounds at least this large mean "to the end"
_MAX_SYM = 64  # longest int vector whose contents are tracked symbolically


# ---------------------------------------------------------------- helpers


def _int_list(ctx: InferCtx, i: int, attr=None) -> list[int] | None:
    """Ints from input ``i`` when given (and known), else from the old-style attribute."""
    if ctx.has(i):
        s = ctx.sym(i)
        if s is None or not all(isinstance(d, int) for d in s):
            return None
        return list(s)
    return None if attr is None else [int(a) for a in attr]


def _dims_list(ctx: InferCtx, i: int) -> list | None:
    """Possibly symbolic contents of int-vector input ``i`` (None entries when unknown)."""
    s = ctx.sym(i)
    return None if s is None else list(s)


def _is_int(d) -> bool:
    return isinstance(d, (int, np.integer))


def _exact_div(total, part):
    """total / part as a dim, or None when it does not divide to an integer expression."""
    if total is None or part is None:
        return None
    if _is_int(total) and _is_int(part):
        return int(total) // int(part) if part and total % part == 0 else None
    q = sympy.simplify(sympy.sympify(total) / sympy.sympify(part))
    if sympy.fraction(q)[1] != 1:
        return None
    return as_dim(q)


def _vec_syms(ctx: InferCtx, syms) -> None:
    if syms is not None and len(syms) <= _MAX_SYM:
        ctx.out_syms = [tuple(syms)]


# ---------------------------------------------------------------- Constant family


def _constant_value(a) -> np.ndarray | None:
    if a.value is not None:
        return np.asarray(a.value)
    if a.sparse_value is not None:
        return np.asarray(a.sparse_value)
    if a.value_float is not None:
        return np.array(a.value_float, np.float32)
    if a.value_floats is not None:
        return np.array(a.value_floats, np.float32)
    if a.value_int is not None:
        return np.array(a.value_int, np.int64)
    if a.value_ints is not None:
        return np.array(a.value_ints, np.int64)
    if a.value_string is not None:
        return np.array(a.value_string, dtype=object)
    if a.value_strings is not None:
        return np.array(list(a.value_strings), dtype=object)
    return None


def _constant(ctx: InferCtx):
    v = _constant_value(ctx.attrs)
    if v is None:
        return [None]
    if v.dtype.kind in "iu" and v.ndim <= 1:
        _vec_syms(ctx, [int(x) for x in v.reshape(-1)])
    return [tensor(DType.from_np(v.dtype), v.shape)]


def _constant_of_shape(ctx: InferCtx):
    v = ctx.attrs.value
    dt = DType.float32 if v is None else DType.from_np(np.asarray(v).dtype)
    dims = _dims_list(ctx, 0)
    if dims is None:
        shp = ctx.shape(0)
        dims = None if shp is None or not _is_int(shp[0]) else [None] * shp[0]
    elif len(dims) == 1 and _is_int(dims[0]) and dims[0] <= _MAX_SYM and dt.is_int:
        fill = 0 if v is None else int(np.asarray(v).reshape(-1)[0])
        _vec_syms(ctx, [fill] * dims[0])
    return [tensor(dt, dims)]


def _range(ctx: InferCtx):
    vals = [ctx.value(i) if ctx.value(i) is not None else ctx.sym(i) for i in range(3)]
    n = None
    if all(v is not None for v in vals):
        s, lim, d = (np.asarray(v).reshape(-1)[0] for v in vals)
        if all(_is_int(v) or isinstance(v, (float, np.floating)) for v in (s, lim, d)):
            n = max(math.ceil((float(lim) - float(s)) / float(d)), 0)
        elif d == 1:  # arange(0, seq) and friends stay symbolic
            n = as_dim(sympy.sympify(lim) - sympy.sympify(s))  # assumes limit >= start
    return [tensor(ctx.dtype(0), (n,))]


def _eye_like(ctx: InferCtx):
    dt = ctx.attrs.dtype
    return [tensor(DType.from_onnx(dt) if dt is not None else ctx.dtype(0), ctx.shape(0))]


# ---------------------------------------------------------------- shape queries


def _shape(ctx: InferCtx):
    s = ctx.shape(0)
    if s is None:
        return [tensor(DType.int64, (None,))]
    start = ctx.attrs.start or 0
    end = ctx.attrs.end
    dims = list(s)[slice(start, end)]
    _vec_syms(ctx, dims)
    return [tensor(DType.int64, (len(dims),))]


def _size(ctx: InferCtx):
    s = ctx.shape(0)
    if s is not None:
        n = prod(s)
        if n is not None:
            ctx.out_syms = [(n,)]
    return [tensor(DType.int64, ())]


# ---------------------------------------------------------------- reshapes


def reshape_dims(in_shape, target: list, allowzero: bool) -> tuple | None:
    """Reshape's output dims from the (possibly symbolic) target: 0 copies, -1 infers."""
    out, neg = [], None
    for i, d in enumerate(target):
        if _is_int(d) and d == 0 and not allowzero:
            d = in_shape[i] if in_shape is not None and i < len(in_shape) else None
        elif _is_int(d) and d == -1:
            neg = i
        out.append(d)
    if neg is not None:
        rest = [d for i, d in enumerate(out) if i != neg]
        total = prod(in_shape) if in_shape is not None else None
        out[neg] = _exact_div(total, prod(rest)) if None not in rest else None
    return tuple(out)


def _reshape(ctx: InferCtx):
    a = ctx.attrs
    target = _dims_list(ctx, 1) if ctx.has(1) else (list(a.shape) if a.shape else None)
    if target is None:
        ts = ctx.shape(1)
        rank = ts[0] if ts is not None and len(ts) == 1 and _is_int(ts[0]) else None
        return [tensor(ctx.dtype(0), None if rank is None else (None,) * rank)]
    dims = reshape_dims(ctx.shape(0), target, bool(a.allowzero))
    if ctx.sym(0) is not None and len(dims) <= 1:  # reshaping a shape vector keeps its contents
        ctx.out_syms = [ctx.sym(0)]
    return [tensor(ctx.dtype(0), dims)]


def _flatten(ctx: InferCtx):
    s = ctx.shape(0)
    if s is None:
        return [tensor(ctx.dtype(0), (None, None))]
    ax = norm_axis(ctx.attrs.axis, len(s))
    return [tensor(ctx.dtype(0), (prod(s[:ax]), prod(s[ax:])))]


def _transpose(ctx: InferCtx):
    s = ctx.shape(0)
    if s is None:
        return [tensor(ctx.dtype(0), None)]
    perm = ctx.attrs.perm or tuple(reversed(range(len(s))))
    return [tensor(ctx.dtype(0), tuple(s[p] for p in perm))]


def _squeeze(ctx: InferCtx):
    s = ctx.shape(0)
    axes = _int_list(ctx, 1, ctx.attrs.axes)
    if ctx.has(1) and axes is None or s is None:
        return [tensor(ctx.dtype(0), None)]
    if axes:
        drop = {norm_axis(a, len(s)) for a in axes}
    elif any(not _is_int(d) for d in s):
        return [tensor(ctx.dtype(0), None)]  # which dims are 1 is unknown
    else:
        drop = {i for i, d in enumerate(s) if d == 1}
    out = tuple(d for i, d in enumerate(s) if i not in drop)
    if ctx.sym(0) is not None and len(out) <= 1:
        ctx.out_syms = [ctx.sym(0)]
    return [tensor(ctx.dtype(0), out)]


def _unsqueeze(ctx: InferCtx):
    s = ctx.shape(0)
    axes = _int_list(ctx, 1, ctx.attrs.axes)
    if axes is None or s is None:
        return [tensor(ctx.dtype(0), None)]
    r = len(s) + len(axes)
    ins = {norm_axis(a, r) for a in axes}
    it = iter(s)
    out = tuple(1 if i in ins else next(it) for i in range(r))
    if ctx.sym(0) is not None and len(out) <= 1:
        ctx.out_syms = [ctx.sym(0)]
    return [tensor(ctx.dtype(0), out)]


def _concat(ctx: InferCtx):
    n = len(ctx.in_types)
    shapes = [ctx.shape(i) for i in range(n)]
    dt = next((ctx.dtype(i) for i in range(n) if ctx.dtype(i) is not None), None)
    known = [s for s in shapes if s is not None]
    if not known:
        return [tensor(dt, None)]
    r = len(known[0])
    ax = norm_axis(ctx.attrs.axis, r)
    out = []
    for k in range(r):
        if k == ax:
            out.append(None if len(known) < n else sum_dims([s[k] for s in known]))
        else:
            out.append(next((s[k] for s in known if s[k] is not None), None))
    syms = [ctx.sym(i) for i in range(n)]
    if r == 1 and all(s is not None for s in syms):
        _vec_syms(ctx, [d for s in syms for d in s])
    return [tensor(dt, out)]


def sum_dims(dims):
    if any(d is None for d in dims):
        return None
    return as_dim(sum(dims[1:], dims[0]))


def _split(ctx: InferCtx):
    s, n, a = ctx.shape(0), ctx.n_out, ctx.attrs
    dt = ctx.dtype(0)
    if s is None:
        return [tensor(dt, None)] * n
    ax = norm_axis(a.axis, len(s))
    sizes = _int_list(ctx, 1, a.split)
    d = s[ax]
    if not sizes:
        if ctx.has(1):
            sizes = None
        elif _is_int(d):
            k = -(-d // n)  # ceil: the last chunk takes what is left
            sizes = [max(min(k, d - k * i), 0) for i in range(n)]
        else:
            q = _exact_div(d, n) if a.num_outputs is None else None
            sizes = [q] * n
    if sizes is None:
        sizes = [None] * n
    return [tensor(dt, tuple(sz if i == ax else x for i, x in enumerate(s))) for sz in sizes]


# ---------------------------------------------------------------- slicing and gathering


def _slice_dim(d, start, end, step):
    if _is_int(d) and _is_int(start) and _is_int(end):
        return len(range(*slice(start, end, step).indices(d)))
    if step != 1 or d is None or start is None or end is None:
        return None
    # symbolic dims are assumed large enough for the bounds the model uses
    if _is_int(end) and end >= _BIG:
        end = d
    elif _is_int(end) and end < 0:
        end = d + end
    elif _is_int(end) and not _is_int(d):
        return None  # min(d, end) is unknown
    if _is_int(start) and start < 0:
        start = d + start
    return as_dim(sympy.sympify(end) - sympy.sympify(start))


def _slice(ctx: InferCtx):
    s, a = ctx.shape(0), ctx.attrs
    dt = ctx.dtype(0)
    if ctx.has(1):
        starts, ends = _dims_list(ctx, 1), _dims_list(ctx, 2)
        axes = _int_list(ctx, 3) if ctx.has(3) else None
        steps = _int_list(ctx, 4) if ctx.has(4) else None
        if ctx.has(3) and axes is None or ctx.has(4) and steps is None:
            return [tensor(dt, None if s is None else (None,) * len(s))]
    else:
        starts, ends, axes, steps = list(a.starts), list(a.ends), a.axes, None
    if s is None:
        return [tensor(dt, None)]
    if starts is None or ends is None:
        return [tensor(dt, (None,) * len(s))]
    axes = list(axes) if axes else list(range(len(starts)))
    steps = list(steps) if steps else [1] * len(starts)
    out = list(s)
    for ax, st, en, sp in zip(axes, starts, ends, steps):
        ax = norm_axis(ax, len(s))
        out[ax] = _slice_dim(s[ax], st, en, sp)
    src = ctx.sym(0)
    if src is not None and len(s) == 1 and len(axes) == 1 and _is_int(starts[0]) \
            and _is_int(ends[0]):
        _vec_syms(ctx, list(src)[slice(starts[0], ends[0], steps[0])])
    return [tensor(dt, out)]


def _gather(ctx: InferCtx):
    s, ind = ctx.shape(0), ctx.shape(1)
    if s is None or ind is None:
        return [tensor(ctx.dtype(0), None)]
    ax = norm_axis(ctx.attrs.axis, len(s))
    src, idx = ctx.sym(0), ctx.sym(1)
    if src is not None and idx is not None and ax == 0 and all(_is_int(i) for i in idx):
        _vec_syms(ctx, [src[int(i)] for i in idx])
    return [tensor(ctx.dtype(0), tuple(s[:ax]) + tuple(ind) + tuple(s[ax + 1:]))]


def _gather_elements(ctx: InferCtx):
    return [tensor(ctx.dtype(0), ctx.shape(1))]


def _gather_nd(ctx: InferCtx):
    s, ind, b = ctx.shape(0), ctx.shape(1), ctx.attrs.batch_dims or 0
    if s is None or ind is None or not _is_int(ind[-1]):
        return [tensor(ctx.dtype(0), None)]
    return [tensor(ctx.dtype(0), tuple(ind[:-1]) + tuple(s[b + ind[-1]:]))]


# ---------------------------------------------------------------- broadcasting and padding


def _expand(ctx: InferCtx):
    s, target = ctx.shape(0), _dims_list(ctx, 1)
    if target is None:
        ts = ctx.shape(1)
        if s is None or ts is None or not _is_int(ts[0]):
            return [tensor(ctx.dtype(0), None)]
        r = max(len(s), ts[0])
        return [tensor(ctx.dtype(0), (None,) * r)]
    # a symbolic target dim may be 1 at run time: keep the input's dim where that is known
    out = broadcast_shapes(s, tuple(target))
    return [tensor(ctx.dtype(0), out)]


def _tile(ctx: InferCtx):
    s, reps = ctx.shape(0), _dims_list(ctx, 1)
    if s is None:
        return [tensor(ctx.dtype(0), None)]
    if reps is None:
        return [tensor(ctx.dtype(0), (None,) * len(s))]
    return [tensor(ctx.dtype(0), tuple(
        None if d is None or r is None else as_dim(d * r) for d, r in zip(s, reps)))]


def _pad(ctx: InferCtx):
    s = ctx.shape(0)
    if s is None:
        return [tensor(ctx.dtype(0), None)]
    pads = _int_list(ctx, 1, ctx.attrs.pads)
    axes = _int_list(ctx, 3) if ctx.has(3) else list(range(len(s)))
    if pads is None or axes is None:
        return [tensor(ctx.dtype(0), (None,) * len(s))]
    out, k = list(s), len(axes)
    for j, ax in enumerate(axes):
        ax = norm_axis(ax, len(s))
        if out[ax] is not None:
            out[ax] = as_dim(out[ax] + pads[j] + pads[j + k])
    return [tensor(ctx.dtype(0), out)]


def _identity(ctx: InferCtx):
    if ctx.sym(0) is not None:
        ctx.out_syms = [ctx.sym(0)]
    return [ctx.type(0)]


def _dropout(ctx: InferCtx):
    return [ctx.type(0), tensor(DType.bool, ctx.shape(0))][:max(ctx.n_out, 1)]


def _same_shape_of(i: int, dtype: DType):
    def rule(ctx: InferCtx):
        return [tensor(dtype, ctx.shape(i))]
    return rule


Constant = onnx_op("Constant", _constant)
ConstantOfShape = onnx_op("ConstantOfShape", _constant_of_shape)
Shape = onnx_op("Shape", _shape)
Size = onnx_op("Size", _size)
Reshape = onnx_op("Reshape", _reshape)
Flatten = onnx_op("Flatten", _flatten)
Transpose = onnx_op("Transpose", _transpose)
Squeeze = onnx_op("Squeeze", _squeeze)
Unsqueeze = onnx_op("Unsqueeze", _unsqueeze)
Concat = onnx_op("Concat", _concat)
Split = onnx_op("Split", _split, num_outputs_attr=True)
Slice = onnx_op("Slice", _slice)
Gather = onnx_op("Gather", _gather)
GatherElements = onnx_op("GatherElements", _gather_elements)
GatherND = onnx_op("GatherND", _gather_nd)
ScatterElements = onnx_op("ScatterElements", same())
Scatter = onnx_op("Scatter", same())
ScatterND = onnx_op("ScatterND", same())
Expand = onnx_op("Expand", _expand)
Tile = onnx_op("Tile", _tile)
Pad = onnx_op("Pad", _pad)
Identity = onnx_op("Identity", _identity)
Range = onnx_op("Range", _range)
OneHot = onnx_op("OneHot", None)
Trilu = onnx_op("Trilu", same())
Compress = onnx_op("Compress", None)
NonZero = onnx_op("NonZero", None)
Unique = onnx_op("Unique", None)
TopK = onnx_op("TopK", None)
ArgMax = onnx_op("ArgMax", None)
ArgMin = onnx_op("ArgMin", None)
CumSum = onnx_op("CumSum", same())
CumProd = onnx_op("CumProd", same())
EyeLike = onnx_op("EyeLike", _eye_like)
DepthToSpace = onnx_op("DepthToSpace", None)
SpaceToDepth = onnx_op("SpaceToDepth", None)
ReverseSequence = onnx_op("ReverseSequence", same())
CenterCropPad = onnx_op("CenterCropPad", None)
Dropout = onnx_op("Dropout", _dropout)
