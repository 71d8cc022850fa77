"""PyTorch kernels: padding, selection, sorting, scans and rearrangement ops."""

from __future__ import annotations

import numpy as np
import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.convert import to_numpy, to_torch
from kiln.kernels.torch.tensor import bits
from kiln.kernels.torch.util import ints, unsigned_safe
from kiln.ops import tensor as T


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


# ---------------------------------------------------------------- Pad and CenterCropPad


def _pad_index(size: int, before: int, after: int, mode: str) -> torch.Tensor:
    """Source position of every output position along one axis (non-constant modes)."""
    pos = torch.arange(-before, size + after)
    if mode == "edge":
        return pos.clamp(0, size - 1)
    if mode == "wrap":
        return pos % size
    if size == 1:  # reflect of a single element repeats it
        return torch.zeros_like(pos)
    period = 2 * (size - 1)
    m = pos % period
    return torch.where(m < size, m, period - m)


@register(T.Pad)
def pad(n, x, pads=None, value=None, axes=None):
    p = ints(pads) if pads is not None else list(n.a.pads or ())
    ax = [_axis(a, x.ndim) for a in ints(axes)] if axes is not None else list(range(x.ndim))
    k = len(ax)
    before, after = [0] * x.ndim, [0] * x.ndim
    for j, a in enumerate(ax):
        before[a], after[a] = p[j], p[j + k]
    # negative pads crop first
    crop = tuple(slice(max(-b, 0), x.shape[i] - max(-e, 0))
                 for i, (b, e) in enumerate(zip(before, after)))
    x = x[crop]
    before = [max(b, 0) for b in before]
    after = [max(e, 0) for e in after]
    mode = n.a.mode or "constant"
    if mode == "constant":
        fill = value.reshape(-1)[0].item() if value is not None and value.numel() else (
            n.a.value if n.a.value is not None else 0)
        out_shape = [d + b + e for d, b, e in zip(x.shape, before, after)]
        out = torch.full(out_shape, fill, dtype=x.dtype)
        out[tuple(slice(b, b + d) for b, d in zip(before, x.shape))] = x
        return out
    for i in range(x.ndim):
        if before[i] or after[i]:
            x = x.index_select(i, _pad_index(x.shape[i], before[i], after[i], mode))
    return x


@register(T.CenterCropPad)
def center_crop_pad(n, x, shape):
    target = ints(shape)
    ax = [_axis(a, x.ndim) for a in n.a.axes] if n.a.axes else list(range(x.ndim))
    out_shape = list(x.shape)
    src = [slice(None)] * x.ndim
    dst = [slice(None)] * x.ndim
    for a, t in zip(ax, target):
        d = x.shape[a]
        out_shape[a] = t
        if t < d:
            off = (d - t) // 2
            src[a] = slice(off, off + t)
        elif t > d:
            off = (t - d) // 2
            dst[a] = slice(off, off + d)
    out = torch.zeros(out_shape, dtype=x.dtype)
    out[tuple(dst)] = x[tuple(src)]
    return out


# ---------------------------------------------------------------- selection


@register(T.OneHot)
def one_hot(n, indices, depth, values):
    d = int(depth.reshape(-1)[0].item())
    idx = indices.to(torch.float64).floor().to(torch.int64) if indices.is_floating_point() \
        else indices.to(torch.int64)
    idx = torch.where(idx < 0, idx + d, idx)
    r = idx.ndim + 1
    ax = _axis(n.a.axis, r)
    hot = idx.unsqueeze(-1) == torch.arange(d)
    hot = hot.movedim(-1, ax)
    off, on = values.reshape(-1)[0], values.reshape(-1)[1]
    return torch.where(hot, on, off)


@register(T.Trilu)
def trilu(n, x, k=None):
    kk = int(k.reshape(-1)[0].item()) if k is not None else 0
    rows, cols = x.shape[-2], x.shape[-1]
    i = torch.arange(rows).unsqueeze(1)
    j = torch.arange(cols).unsqueeze(0)
    keep = (j - i >= kk) if n.a.upper else (j - i <= kk)
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype))


@register(T.Compress)
def compress(n, x, cond):
    if n.a.axis is None:
        x, ax = x.reshape(-1), 0
    else:
        ax = _axis(n.a.axis, x.ndim)
    keep = torch.nonzero(cond.reshape(-1)).reshape(-1)
    keep = keep[keep < x.shape[ax]]
    return x.index_select(ax, keep)


@register(T.NonZero)
def nonzero(n, x):
    if x.ndim == 0:
        return torch.zeros((0, int(bool(x.item()))), dtype=torch.int64)
    return torch.nonzero(x).T.contiguous()


# ---------------------------------------------------------------- sorting


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """A tensor torch can sort/compare that orders like ``x`` (torch lacks unsigned kernels)."""
    if x.dtype == torch.uint64:  # flipping the sign bit maps uint64 order onto int64 order
        return x.view(torch.int64) ^ torch.tensor(-(1 << 63), dtype=torch.int64)
    if x.dtype in (torch.uint16, torch.uint32):
        return x.to(torch.int64)
    return x


@register(T.TopK)
def top_k(n, x, k=None):
    kk = int(k.reshape(-1)[0].item()) if k is not None else int(n.a.k)
    ax = _axis(n.a.axis, x.ndim)
    largest = n.a.largest is None or bool(n.a.largest)
    # a stable sort keeps equal values in index order, as ONNX requires
    _, idx = torch.sort(_order_key(x), dim=ax, descending=largest, stable=True)
    idx = idx.narrow(ax, 0, kk)
    if x.dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: torch.int16, torch.uint32: torch.int32}.get(x.dtype, torch.int64)
        return torch.gather(x.view(signed), ax, idx).view(x.dtype), idx
    return torch.gather(x, ax, idx), idx


def _arg(n, x, fn):
    x = _order_key(x)
    ax = _axis(n.a.axis or 0, x.ndim)
    keep = n.a.keepdims is None or bool(n.a.keepdims)
    if n.a.select_last_index:
        out = x.shape[ax] - 1 - fn(x.flip(ax), dim=ax, keepdim=keep)
    else:
        out = fn(x, dim=ax, keepdim=keep)
    return out.to(torch.int64)


@register(T.ArgMax)
def arg_max(n, x):
    return _arg(n, x, torch.argmax)


@register(T.ArgMin)
def arg_min(n, x):
    return _arg(n, x, torch.argmin)


@register(T.Unique)
def unique(n, x):
    a = to_numpy(x)
    work = a.astype(np.float32) if a.dtype.kind == "V" or a.dtype.itemsize < 4 and \
        a.dtype.kind == "f" and a.dtype != np.float16 else a
    ax = None if n.a.axis is None else _axis(n.a.axis, a.ndim)
    _, first, inverse, counts = np.unique(work, return_index=True, return_inverse=True,
                                          return_counts=True, axis=ax)
    inverse = inverse.reshape(-1)
    if n.a.sorted is not None and not n.a.sorted:  # order of first occurrence instead
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, counts, inverse = first[order], counts[order], rank[inverse]
    flat = a.reshape(-1) if ax is None else a
    y = flat[first] if ax is None else np.take(a, first, axis=ax)
    outs = (to_torch(y), torch.from_numpy(first.astype(np.int64)),
            torch.from_numpy(inverse.astype(np.int64)), torch.from_numpy(counts.astype(np.int64)))
    return outs[:n.n_out]


# ---------------------------------------------------------------- scans


def _scan(n, x, axis, fn):
    ax = _axis(int(axis.reshape(-1)[0].item()), x.ndim)
    if n.a.reverse:
        x = x.flip(ax)
    out = fn(x, dim=ax, dtype=x.dtype)
    if n.a.exclusive:  # shift by one: the identity first, the last partial result dropped
        first = out.narrow(ax, 0, 1)
        ident = torch.ones_like(first) if fn is torch.cumprod else torch.zeros_like(first)
        out = torch.cat([ident, out.narrow(ax, 0, x.shape[ax] - 1)], dim=ax)
    return out.flip(ax) if n.a.reverse else out


@register(T.CumSum)
@unsigned_safe
def cum_sum(n, x, axis):
    return _scan(n, x, axis, torch.cumsum)


@register(T.CumProd)
@unsigned_safe
def cum_prod(n, x, axis):
    return _scan(n, x, axis, torch.cumprod)


# ---------------------------------------------------------------- rearrangement


@register(T.DepthToSpace)
def depth_to_space(n, x):
    b = n.a.blocksize
    nb, c, h, w = x.shape
    if (n.a.mode or "DCR") == "DCR":
        y = x.reshape(nb, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(nb, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(nb, c // (b * b), h * b, w * b)


@register(T.SpaceToDepth)
def space_to_depth(n, x):
    b = n.a.blocksize
    nb, c, h, w = x.shape
    y = x.reshape(nb, c, h // b, b, w // b, b)
    if (n.a.mode or "DCR") == "DCR":
        y = y.permute(0, 3, 5, 1, 2, 4)
    else:
        y = y.permute(0, 1, 3, 5, 2, 4)
    return y.reshape(nb, c * b * b, h // b, w // b)


@register(T.ReverseSequence)
def reverse_sequence(n, x, lens):
    bax, tax = n.a.batch_axis or 0, n.a.time_axis if n.a.time_axis is not None else 1
    y = x.movedim((bax, tax), (0, 1))
    nb, nt = y.shape[0], y.shape[1]
    t = torch.arange(nt).unsqueeze(0)
    ln = lens.to(torch.int64).unsqueeze(1)
    src = torch.where(t < ln, ln - 1 - t, t)  # (batch, time)
    idx = src.reshape(nb, nt, *([1] * (y.ndim - 2))).expand(y.shape)
    return torch.gather(bits(y), 1, idx).view(y.dtype).movedim((0, 1), (bax, tax))


@register(T.Dropout)
def dropout(n, x, ratio=None, training_mode=None):
    training = training_mode is not None and bool(training_mode.reshape(-1)[0].item())
    r = float(ratio.reshape(-1)[0].item()) if ratio is not None else (
        n.a.ratio if n.a.ratio is not None else 0.5)
    if not training or r == 0:
        return (x, torch.ones(x.shape, dtype=torch.bool, device=x.device)) if n.n_out > 1 else x
    if n.a.seed is not None:  # a seeded mask is reproducible: MT19937, as numpy (and ONNX) draw it
        u = np.random.RandomState(int(n.a.seed)).uniform(0.0, 1.0, tuple(x.shape))
        mask = torch.as_tensor(u >= r, device=x.device)
    else:
        mask = torch.rand(x.shape, device=x.device) >= r
    y = torch.where(mask, x * (1.0 / (1.0 - r)), torch.zeros((), dtype=x.dtype))
    return (y, mask) if n.n_out > 1 else y
