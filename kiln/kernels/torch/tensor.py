"""PyTorch kernels: tensor manipulation and shape ops.

Shape-only ops also accept numpy arrays (strings, 4-bit types), which torch cannot hold; those
go through the numpy equivalent of the same operation.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE, to_torch
from kiln.kernels.torch.util import ints, unsigned_safe
from kiln.ops import tensor as T
from kiln.ops.rules import broadcast_ints


def _is_np(x) -> bool:
    return isinstance(x, np.ndarray)



def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


_SAME_WIDTH = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64,
               torch.float8_e4m3fn: torch.uint8, torch.float8_e4m3fnuz: torch.uint8,
               torch.float8_e5m2: torch.uint8, torch.float8_e5m2fnuz: torch.uint8,
               torch.float8_e8m0fnu: torch.uint8}


def bits(x: torch.Tensor) -> torch.Tensor:
    """A same-width view torch has gather/scatter kernels for (pure data movement only)."""
    return x.view(_SAME_WIDTH[x.dtype]) if x.dtype in _SAME_WIDTH else x


def _torch_dtype(onnx_code: int) -> torch.dtype | None:
    return TORCH_DTYPE.get(DType.from_onnx(onnx_code))


# ---------------------------------------------------------------- constants


@register(T.Constant)
def constant(n):
    v = T._constant_value(n.a)
    if v is None:
        raise ValueError("Constant has none of its value attributes")
    out = to_torch(v)  # shares the attribute's memory: hand out a copy
    return out.clone() if isinstance(out, torch.Tensor) else out


@register(T.ConstantOfShape)
def constant_of_shape(n, shape):
    v = n.a.value
    v = np.zeros((1,), np.float32) if v is None else np.asarray(v)
    fill = to_torch(v.reshape(-1)[:1])
    dims = ints(shape)
    if _is_np(fill):
        return np.full(dims, fill[0], dtype=fill.dtype)
    # full, not the (host) fill tensor expanded: made on the device a CUDA engine runs it under
    return torch.full(dims, fill.reshape(()).item(), dtype=fill.dtype)


@register(T.Shape)
def shape(n, x):
    dims = list(x.shape)[slice(n.a.start or 0, n.a.end)]
    return torch.tensor(dims, dtype=torch.int64)


@register(T.Size)
def size(n, x):
    return torch.tensor(int(np.prod(x.shape, dtype=np.int64)), dtype=torch.int64)


@register(T.EyeLike)
def eye_like(n, x):
    dt = _torch_dtype(n.a.dtype) if n.a.dtype is not None else x.dtype
    rows, cols = x.shape
    i = torch.arange(rows).unsqueeze(1)
    j = torch.arange(cols).unsqueeze(0)
    return (j - i == (n.a.k or 0)).to(dt)


@register(T.Range)
def range_(n, start, limit, delta):
    s, lim, d = start.item(), limit.item(), delta.item()
    count = max(int(np.ceil((lim - s) / d)), 0)
    dt = start.dtype
    if dt.is_floating_point:  # computed in double, as the spec's loop accumulates exactly
        return (s + torch.arange(count, dtype=torch.float64) * d).to(dt)
    return (s + torch.arange(count, dtype=torch.int64) * d).to(dt)


# ---------------------------------------------------------------- reshapes


def reshape_target(in_shape, target: list[int], allowzero: bool) -> list[int]:
    out = [in_shape[i] if t == 0 and not allowzero else t for i, t in enumerate(target)]
    if -1 in out:
        k = out.index(-1)
        rest = int(np.prod([d for i, d in enumerate(out) if i != k], dtype=np.int64))
        total = int(np.prod(in_shape, dtype=np.int64))
        if rest == 0 or total % rest:
            raise ValueError(f"cannot reshape {tuple(in_shape)} to {target}")
        out[k] = total // rest
    return out


@register(T.Reshape)
def reshape(n, x, shape=None):
    target = ints(shape) if shape is not None else list(n.a.shape or ())
    return x.reshape(reshape_target(list(x.shape), target, bool(n.a.allowzero)))


@register(T.Flatten)
def flatten(n, x):
    ax = _axis(n.a.axis, x.ndim)
    lead = int(np.prod(x.shape[:ax], dtype=np.int64))
    return x.reshape(lead, int(np.prod(x.shape[ax:], dtype=np.int64)))


@register(T.Transpose)
def transpose(n, x):
    perm = list(n.a.perm) if n.a.perm else list(reversed(range(x.ndim)))
    if _is_np(x):
        return np.ascontiguousarray(np.transpose(x, perm))
    return x.permute(perm)


def _axes(n, axes_in) -> list[int]:
    if axes_in is not None:
        return ints(axes_in)
    return list(n.a.axes or ())


@register(T.Squeeze)
def squeeze(n, x, axes=None):
    ax = _axes(n, axes)
    if not ax:
        ax = [i for i, d in enumerate(x.shape) if d == 1]
    drop = {_axis(a, x.ndim) for a in ax}
    return x.reshape([d for i, d in enumerate(x.shape) if i not in drop])


@register(T.Unsqueeze)
def unsqueeze(n, x, axes=None):
    ax = _axes(n, axes)
    r = x.ndim + len(ax)
    ins = {_axis(a, r) for a in ax}
    it = iter(x.shape)
    return x.reshape([1 if i in ins else next(it) for i in range(r)])


@register(T.Concat)
def concat(n, *xs):
    if any(_is_np(x) for x in xs):
        return np.concatenate([np.asarray(x) for x in xs], axis=n.a.axis)
    return torch.cat(xs, dim=n.a.axis)


@register(T.Split)
def split(n, x, split_in=None):
    ax = _axis(n.a.axis, x.ndim)
    sizes = ints(split_in) if split_in is not None else list(n.a.split or ())
    if not sizes:
        d, k = x.shape[ax], n.n_out
        step = -(-d // k)
        sizes = [max(min(step, d - step * i), 0) for i in range(k)]
    if _is_np(x):
        return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=ax))
    return tuple(torch.split(x, sizes, dim=ax))


@register(T.Identity)
def identity(n, x):
    return x


# ---------------------------------------------------------------- slicing and gathering


@register(T.Slice)
def slice_(n, x, starts=None, ends=None, axes=None, steps=None):
    if starts is not None:
        key = (tuple(ints(starts)), tuple(ints(ends)),
               None if axes is None else tuple(ints(axes)),
               None if steps is None else tuple(ints(steps)), tuple(x.shape))
    else:  # opset < 10: attributes
        key = (tuple(n.a.starts), tuple(n.a.ends), tuple(n.a.axes) if n.a.axes else None, None,
               tuple(x.shape))
    # the index for these values and this input shape, worked out once (a node sees few)
    plans = n.cache.setdefault("slice_plans", {})
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= 16:
            plans.clear()
        plan = plans[key] = _slice_plan(x.ndim, *key)
    index, flips = plan
    out = x[index]
    if flips:
        out = np.flip(out, flips) if _is_np(out) else out.flip(flips)
    return out


def _slice_plan(ndim: int, st, en, ax, sp, shape) -> tuple[tuple, list]:
    ax = list(ax) if ax is not None else list(range(len(st)))
    sp = list(sp) if sp is not None else [1] * len(st)
    index = [slice(None)] * ndim
    flips = []
    for a, s, e, p in zip(ax, st, en, sp):
        a = _axis(a, ndim)
        b, f, step = slice(s, e, p).indices(shape[a])
        if p > 0:
            index[a] = slice(b, max(f, b), step)
        else:  # torch has no negative steps: take the mirrored range, then flip
            count = len(range(b, f, step))
            lo = b + step * (count - 1) if count else 0
            index[a] = slice(lo, lo + (-step) * (count - 1) + 1 if count else 0, -step)
            flips.append(a)
    return tuple(index), flips


def _norm_index(idx, dim: int):
    return torch.where(idx < 0, idx + dim, idx)


@register(T.Gather)
def gather(n, x, idx):
    ax = _axis(n.a.axis, x.ndim)
    if _is_np(x):
        return np.take(x, np.asarray(idx.numpy() if hasattr(idx, "numpy") else idx), axis=ax)
    if idx.dim() == 0:  # one index: a view (shapes, axes and heads are gathered this way)
        i, size = int(idx), x.shape[ax]
        if not -size <= i < size:
            raise IndexError(f"Gather: index {i} out of range for axis {ax} of size {size}")
        return x.select(ax, i + size if i < 0 else i)
    # one advanced index: torch wraps negative indices and refuses out-of-range ones itself, in
    # one op (index_select after a where on the indices was four: 7.4 us against 2.2 for an
    # embedding row, a decode step's every Gather)
    return x[(slice(None),) * ax + (idx.to(torch.int64),)]


@register(T.GatherElements)
def gather_elements(n, x, idx):
    ax = _axis(n.a.axis, x.ndim)
    return torch.gather(bits(x), ax, _norm_index(idx.to(torch.int64), x.shape[ax])).view(x.dtype)


def leading_axis_rows(batch_dims: int, idx) -> bool:
    """Whether GatherND's indices each address one slice along the leading axis (batch_dims 0,
    a last dim of 1: ``x[idx[..., 0]]``), which :func:`gather_nd` takes by ``index_select``."""
    return batch_dims == 0 and idx.dim() >= 1 and idx.shape[-1] == 1


@register(T.GatherND)
def gather_nd(n, x, idx):
    b = n.a.batch_dims or 0
    idx = idx.to(torch.int64)
    if leading_axis_rows(b, idx) and x.dim() >= 1:
        # a detector's boxes and scores picked by Transpose(NonZero(...)): one index_select
        # (the general path's where, arange and two-tensor indexing: 38 us against 15 for 300
        # rows of a [3234, 4] table on a loaded machine, 40 times per tv_ssdlite320 run)
        flat, size = idx.reshape(-1), x.shape[0]
        try:
            rows = torch.index_select(x, 0, torch.where(flat < 0, flat + size, flat))
        except (IndexError, RuntimeError):  # torch's own message names no node
            bad = flat[(flat < -size) | (flat >= size)]
            raise IndexError(f"GatherND {n.node_name}: index {int(bad[0]) if bad.numel() else '?'}"
                             f" out of range for the leading axis (size {size}) of data "
                             f"{tuple(x.shape)}") from None
        return rows.reshape(idx.shape[:-1] + x.shape[1:])
    k = idx.shape[-1]
    batch = x.shape[:b]
    nb = int(np.prod(batch, dtype=np.int64))
    xs = x.reshape((nb,) + x.shape[b:])
    ix = idx.reshape(nb, -1, k)
    lim = torch.tensor(x.shape[b:b + k], dtype=torch.int64)
    ix = torch.where(ix < 0, ix + lim, ix)
    bi = torch.arange(nb).unsqueeze(1).expand(nb, ix.shape[1])
    out = xs[(bi,) + tuple(ix[..., j] for j in range(k))]
    return out.reshape(idx.shape[:-1] + x.shape[b + k:])


_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_elements(x, idx, upd, axis: int, reduction: str):
    ax = _axis(axis, x.ndim)
    idx = _norm_index(idx.to(torch.int64), x.shape[ax])
    if reduction in (None, "none"):
        return torch.scatter(bits(x), ax, idx, bits(upd)).view(x.dtype)
    return torch.scatter_reduce(x, ax, idx, upd, _REDUCE[reduction], include_self=True)


@register(T.ScatterElements)
@unsigned_safe
def scatter_elements(n, x, idx, upd):
    return _scatter_elements(x, idx, upd, n.a.axis, n.a.reduction)


@register(T.Scatter)
@unsigned_safe
def scatter(n, x, idx, upd):
    return _scatter_elements(x, idx, upd, n.a.axis, None)


@register(T.ScatterND)
@unsigned_safe
def scatter_nd(n, x, idx, upd):
    idx = idx.to(torch.int64)
    k = idx.shape[-1]
    lead = x.shape[:k]
    lim = torch.tensor(lead, dtype=torch.int64)
    idx = torch.where(idx < 0, idx + lim, idx).reshape(-1, k)
    strides = torch.tensor([int(np.prod(lead[j + 1:], dtype=np.int64)) for j in range(k)])
    lin = (idx * strides).sum(-1)
    out = x.reshape((-1,) + x.shape[k:]).clone()
    u = upd.reshape((-1,) + x.shape[k:])
    red = n.a.reduction
    if red in (None, "none"):
        out[lin] = u
    elif red == "add":
        out.index_add_(0, lin, u)
    else:
        flat = out.reshape(out.shape[0], -1)
        li = lin.unsqueeze(1).expand(-1, flat.shape[1])
        flat.scatter_reduce_(0, li, u.reshape(u.shape[0], -1), _REDUCE[red], include_self=True)
    return out.reshape(x.shape)


# ---------------------------------------------------------------- broadcasting


@register(T.Expand)
def expand(n, x, shape):
    try:
        target = broadcast_ints(tuple(x.shape), tuple(ints(shape)))
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    if _is_np(x):
        return np.broadcast_to(x, target).copy()
    return x.expand(target)


@register(T.Tile)
def tile(n, x, repeats):
    reps = ints(repeats)
    if _is_np(x):
        return np.tile(x, reps)
    return x.repeat(reps)


# the less common ops live in a second module; importing it registers them
