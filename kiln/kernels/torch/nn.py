"""PyTorch kernels: convolutions and pooling.

Fast paths hand common cases (symmetric pads, 1-3 spatial dims) straight to
``torch.nn.functional``; everything else (asymmetric or large pads, ceil-mode corner cases,
dilated average pooling, more spatial dims) goes through one explicit pad + ``unfold`` path that
follows the ONNX window semantics exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.kernels.registry import cudnn, register
from kiln.ops import nn as N

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pad_spatial(x, begin, end, value=0.0):
    """Pad (or crop, for negative amounts) the spatial dims of an N,C,... tensor."""
    if not any(begin) and not any(end):
        return x
    flat = []
    for b, e in zip(reversed(begin), reversed(end)):
        flat += [b, e]
    return F.pad(x, flat, value=value)


# ---------------------------------------------------------------- Conv


@register(N.Conv, makes_plan=cudnn)
def conv(n, x, w, b=None):
    a = n.a
    n_sp = x.dim() - 2
    k, s, d, p = N.spatial_attrs(a, n_sp, list(w.shape[2:]))
    _, pb, pe = N.window_geometry(list(x.shape[2:]), k, s, d, p, a.auto_pad)
    if pb != pe:  # torch pads symmetrically only
        x = _pad_spatial(x, pb, pe)
        pb = [0] * n_sp
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    fn = _CONV.get(n_sp)
    if fn is not None:
        return fn(x, w, b, s, pb, d, a.group or 1)
    return _conv_nd(x, w, b, k, s, d, a.group or 1)


def _conv_nd(x, w, b, k, s, d, group):
    """Convolution over any number of spatial dims (already padded) via unfold + matmul."""
    n_sp = x.dim() - 2
    cols = x
    for i in range(n_sp):
        dk = (k[i] - 1) * d[i] + 1
        cols = cols.unfold(2 + i, dk, s[i])[..., ::d[i]]
    out_sp = cols.shape[2:2 + n_sp]
    nb, c = x.shape[:2]
    # cols: N, C, *out, *k -> N, G, C/G * prod(k), prod(out)
    cols = cols.permute(0, 1, *range(2 + n_sp, 2 + 2 * n_sp), *range(2, 2 + n_sp))
    cols = cols.reshape(nb, group, (c // group) * math.prod(k), math.prod(out_sp))
    wg = w.reshape(group, w.shape[0] // group, -1)
    y = torch.matmul(wg.unsqueeze(0), cols).reshape(nb, w.shape[0], *out_sp)
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * n_sp))
    return y


@register(N.ConvTranspose, makes_plan=cudnn)
def conv_transpose(n, x, w, b=None):
    a = n.a
    n_sp = x.dim() - 2
    kernel = list(a.kernel_shape or w.shape[2:])
    _, s, d, _ = N.spatial_attrs(a, n_sp, kernel)
    _, pb, pe = N.convtranspose_geometry(list(x.shape[2:]), a, kernel)
    group = a.group or 1
    op = list(a.output_padding or [0] * n_sp)
    fn = _CONVT.get(n_sp)
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    # torch only supports symmetric, non-negative pads with output_padding < stride: otherwise
    # compute the full result and pad/crop it ourselves (zero fill, then the bias)
    simple = (fn is not None and pb == pe and min(pb) >= 0
              and all(o < max(si, di) for o, si, di in zip(op, s, d)))
    if simple:
        return fn(x, w, b, s, pb, op, group, d)
    if fn is None:
        raise NotImplementedError(f"ConvTranspose with {n_sp} spatial dims")
    y = fn(x, w, None, s, 0, 0, group, d)
    y = _pad_spatial(y, [-v for v in pb], [o - v for o, v in zip(op, pe)])
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * n_sp))
    return y


# ---------------------------------------------------------------- DeformConv


def _bilinear_gather(x, py, px):
    """Sample x [N, G, Cg, H, W] at float positions py, px [N, G, P] (zero outside)."""
    nb, g, cg, h, wd = x.shape
    flat = x.reshape(nb, g, cg, h * wd)
    y0, x0 = torch.floor(py), torch.floor(px)
    out = 0
    for dy in (0, 1):
        for dx in (0, 1):
            yy, xx = y0 + dy, x0 + dx
            wgt = (1 - (py - yy).abs()) * (1 - (px - xx).abs())
            ok = (yy >= 0) & (yy <= h - 1) & (xx >= 0) & (xx <= wd - 1)
            idx = (yy.clamp(0, h - 1) * wd + xx.clamp(0, wd - 1)).long()
            vals = torch.gather(flat, 3, idx.unsqueeze(2).expand(nb, g, cg, idx.shape[-1]))
            out = out + vals * (wgt * ok).unsqueeze(2)
    return out


@register(N.DeformConv)
def deform_conv(n, x, w, offset, b=None, mask=None):
    a = n.a
    if x.dim() != 4:
        raise NotImplementedError("DeformConv supports 2 spatial dims")
    nb, c, h, wd = x.shape
    kh, kw = list(a.kernel_shape or w.shape[2:])
    _, s, d, p = N.spatial_attrs(a, 2, [kh, kw])
    oh, ow = offset.shape[2:]
    og = a.offset_group or 1
    kk = kh * kw
    # base sampling grid: [K, oH, oW] for y and x
    ky = torch.arange(kh, dtype=x.dtype).repeat_interleave(kw) * d[0]
    kx = torch.arange(kw, dtype=x.dtype).repeat(kh) * d[1]
    by = torch.arange(oh, dtype=x.dtype) * s[0] - p[0]
    bx = torch.arange(ow, dtype=x.dtype) * s[1] - p[1]
    base_y = ky[:, None, None] + by[None, :, None]
    base_x = kx[:, None, None] + bx[None, None, :]
    off = offset.reshape(nb, og, kk, 2, oh, ow)
    py = (base_y + off[:, :, :, 0]).reshape(nb, og, -1)
    px = (base_x + off[:, :, :, 1]).reshape(nb, og, -1)
    cols = _bilinear_gather(x.reshape(nb, og, c // og, h, wd), py, px)  # N, og, Cg, K*L
    if mask is not None:
        cols = cols * mask.reshape(nb, og, 1, kk * oh * ow)
    group = a.group or 1
    cols = cols.reshape(nb, group, (c // group), kk, oh * ow).reshape(nb, group, -1, oh * ow)
    wg = w.reshape(group, w.shape[0] // group, -1)
    y = torch.matmul(wg.unsqueeze(0), cols).reshape(nb, w.shape[0], oh, ow)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y


# ---------------------------------------------------------------- pooling


def _pool_setup(n, x):
    a = n.a
    n_sp = x.dim() - 2
    k, s, d, p = N.spatial_attrs(a, n_sp)
    ceil = bool(getattr(a, "ceil_mode", 0))
    out, pb, pe = N.window_geometry(list(x.shape[2:]), k, s, d, p, a.auto_pad, ceil)
    return k, s, d, out, pb, pe


def _windows(x, k, s, d, out, pb, value):
    """x padded to exactly cover ``out`` windows, unfolded: [N, C, *out, *k]."""
    n_sp = len(k)
    need = [(o - 1) * si + (ki - 1) * di + 1 for o, si, ki, di in zip(out, s, k, d)]
    xp = _pad_spatial(x, pb, [nd - xi - b for nd, xi, b in zip(need, x.shape[2:], pb)], value)
    for i in range(n_sp):
        dk = (k[i] - 1) * d[i] + 1
        xp = xp.unfold(2 + i, dk, s[i])[..., ::d[i]]
    return xp


def _torch_friendly(k, pb, pe, n_sp):
    return n_sp in _MAXPOOL and pb == pe and all(p <= ki // 2 for p, ki in zip(pb, k))


def _fill_min(dtype):
    return float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min


@register(N.MaxPool)
def max_pool(n, x):
    k, s, d, out, pb, pe = _pool_setup(n, x)
    n_sp = len(k)
    want_idx = n.n_out > 1
    if _torch_friendly(k, pb, pe, n_sp) and x.dtype.is_floating_point:
        # torch's ceil rule equals ONNX's, so it yields the same output size
        r = _MAXPOOL[n_sp](x, k, s, pb, d, ceil_mode=bool(n.a.ceil_mode),
                           return_indices=want_idx)
        if want_idx:
            return r[0], _onnx_indices(r[1], x.shape, n.a.storage_order)
        return r
    win = _windows(x, k, s, d, out, pb, _fill_min(x.dtype))
    flat = win.reshape(*win.shape[:2 + n_sp], -1)
    if not want_idx:
        return flat.amax(-1)
    y, j = flat.max(-1)
    # window offset j -> input coordinates -> flat spatial index (row-major)
    idx = torch.zeros_like(j)
    rem = j
    coords = []
    for i in reversed(range(n_sp)):
        coords.append(rem % k[i])
        rem = rem // k[i]
    coords.reverse()
    for i in range(n_sp):
        o = torch.arange(out[i]).reshape(*([1] * (2 + i)), -1, *([1] * (n_sp - i - 1)))
        pos = o * s[i] + coords[i] * d[i] - pb[i]
        idx = idx * x.shape[2 + i] + pos
    return y, _onnx_indices(idx, x.shape, n.a.storage_order)


def _onnx_indices(idx, shape, storage_order):
    """Per-plane row-major spatial index -> ONNX's index into the whole tensor."""
    sp = list(shape[2:])
    plane = math.prod(sp)
    if storage_order:  # column-major over the spatial dims
        coords, rem = [], idx
        for size in reversed(sp):
            coords.append(rem % size)
            rem = rem // size
        coords.reverse()
        idx = torch.zeros_like(idx)
        for i in reversed(range(len(sp))):
            idx = idx * sp[i] + coords[i]
    nc = torch.arange(shape[0] * shape[1]).reshape(shape[0], shape[1], *([1] * len(sp)))
    return idx + nc * plane


def _window_counts(x, k, s, d, out, pb, pe, include_pad):
    """How many elements each window averages over: a product of per-dim counts."""
    cnt = None
    for i in range(len(k)):
        lo, hi = (-pb[i], x.shape[2 + i] + pe[i]) if include_pad else (0, x.shape[2 + i])
        pos = torch.arange(out[i])[:, None] * s[i] + torch.arange(k[i])[None, :] * d[i] - pb[i]
        c = ((pos >= lo) & (pos < hi)).sum(1)
        cnt = c if cnt is None else cnt.unsqueeze(-1) * c
    return cnt


@register(N.AveragePool)
def average_pool(n, x):
    k, s, d, out, pb, pe = _pool_setup(n, x)
    n_sp = len(k)
    include = bool(n.a.count_include_pad)
    if _torch_friendly(k, pb, pe, n_sp) and all(v == 1 for v in d):
        return _AVGPOOL[n_sp](x, k, s, pb, ceil_mode=bool(n.a.ceil_mode),
                              count_include_pad=include)
    win = _windows(x, k, s, d, out, pb, 0.0)
    total = win.sum(dim=tuple(range(-n_sp, 0)))
    cnt = _window_counts(x, k, s, d, out, pb, pe, include)
    return (total / cnt.to(total.dtype).clamp(min=1)).to(x.dtype)


@register(N.LpPool)
def lp_pool(n, x):
    k, s, d, out, pb, _ = _pool_setup(n, x)
    p = float(n.a.p if n.a.p is not None else 2)
    win = _windows(x, k, s, d, out, pb, 0.0)
    dims = tuple(range(-len(k), 0))
    return win.abs().pow(p).sum(dim=dims).pow(1.0 / p).to(x.dtype)


@register(N.GlobalAveragePool)
def global_average_pool(n, x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@register(N.GlobalMaxPool)
def global_max_pool(n, x):
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


@register(N.GlobalLpPool)
def global_lp_pool(n, x):
    p = float(n.a.p if n.a.p is not None else 2)
    dims = tuple(range(2, x.dim()))
    return x.abs().pow(p).sum(dim=dims, keepdim=True).pow(1.0 / p).to(x.dtype)


@register(N.MaxUnpool)
def max_unpool(n, x, indices, output_shape=None):
    n_sp = x.dim() - 2
    k, s, _, p = N.spatial_attrs(n.a, n_sp)
    inferred = [(xi - 1) * si - (p[i] + p[i + n_sp]) + k[i]
                for i, (xi, si) in enumerate(zip(x.shape[2:], s))]
    full = [x.shape[0], x.shape[1], *inferred]
    y = torch.zeros(math.prod(full), dtype=x.dtype)
    y[indices.reshape(-1).long()] = x.reshape(-1)
    y = y.reshape(full)
    if output_shape is not None:
        want = [int(v) for v in output_shape.reshape(-1).tolist()]
        y = _pad_spatial(y, [0] * n_sp, [w - f for w, f in zip(want[2:], inferred)])
    return y


# ---------------------------------------------------------------- Col2Im


@register(N.Col2Im)
def col2im(n, x, image_shape, block_shape):
    img = [int(v) for v in image_shape.reshape(-1).tolist()]
    blk = [int(v) for v in block_shape.reshape(-1).tolist()]
    n_sp = len(img)
    d = list(n.a.dilations or [1] * n_sp)
    s = list(n.a.strides or [1] * n_sp)
    p = list(n.a.pads or [0] * (2 * n_sp))
    if n_sp == 2 and p[:2] == p[2:]:
        return F.fold(x, img, blk, dilation=d, padding=p[:2], stride=s)
    # general case: scatter-add every (block offset, window) into the padded image
    padded = [img[i] + p[i] + p[i + n_sp] for i in range(n_sp)]
    outs = [(padded[i] - ((blk[i] - 1) * d[i] + 1)) // s[i] + 1 for i in range(n_sp)]
    pos = torch.zeros((), dtype=torch.long)
    for i in range(n_sp):  # block offsets (slow axis) x window positions, per dim
        shape = [1] * (2 * n_sp)
        kb = (torch.arange(blk[i]) * d[i]).reshape(*shape[:i], -1, *shape[i + 1:])
        ob = (torch.arange(outs[i]) * s[i]).reshape(*shape[:n_sp + i], -1,
                                                    *shape[n_sp + i + 1:])
        pos = pos * padded[i] + kb + ob
    nb = x.shape[0]
    c = x.shape[1] // math.prod(blk)
    y = torch.zeros(nb, c, math.prod(padded), dtype=x.dtype)
    y.index_add_(2, pos.reshape(-1), x.reshape(nb, c, -1))
    y = y.reshape(nb, c, *padded)
    return _pad_spatial(y, [-v for v in p[:n_sp]], [-v for v in p[n_sp:]])
