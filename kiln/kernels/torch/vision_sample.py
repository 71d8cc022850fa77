"""PyTorch kernels: GridSample, AffineGrid, RoiAlign, NonMaxSuppression."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.kernels.torch.util import ints
from kiln.ops import vision as V

# ONNX opset 16 spelled the GridSample modes like PyTorch; opset 20 renamed them
_GS_MODE = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest",
            "cubic": "bicubic", "bicubic": "bicubic"}


def _reflect(v, lo: float, hi: float):
    """Fold coordinates outside [lo, hi] back in by repeated reflection at the borders."""
    rng = hi - lo
    below, above = v < lo, v > hi
    dx = torch.where(below, lo - v, v - hi)
    k = torch.floor(dx / rng)
    r = dx - k * rng
    even = torch.remainder(k, 2) == 0
    from_below = torch.where(even, lo + r, hi - r)
    from_above = torch.where(even, hi - r, lo + r)
    return torch.where(below, from_below, torch.where(above, from_above, v))


def _pad_cubic_grid(grid, spatial, padding: str, align: bool):
    """ONNX's cubic GridSample clamps/reflects the source coordinate itself when it lies outside
    the image, before padding each tap; torch pads only the taps. Apply the first step to the
    grid so torch's sampler then matches."""
    g = grid.double()
    comps = []
    for k, size in enumerate(reversed(spatial)):  # grid's last axis lists x (width) first
        c = g[..., k]
        v = (c + 1) / 2 * (size - 1) if align else ((c + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        out = (v < lo) | (v > hi)
        if padding == "border":
            v = torch.where(out, v.clamp(0, size - 1), v)
        elif hi > lo:  # a 1-pixel axis with align_corners has nothing to reflect in
            v = _reflect(v, lo, hi)
        if align:
            c = v / (size - 1) * 2 - 1 if size > 1 else torch.zeros_like(v)
        else:
            c = (2 * v + 1) / size - 1
        comps.append(c)
    return torch.stack(comps, -1).to(grid.dtype)


@register(V.GridSample)
def grid_sample(n, x, grid):
    # torch.nn.functional.grid_sample implements the same sampling (ONNX follows it, including
    # round-half-to-even for nearest); only cubic's handling of outside points differs
    mode = _GS_MODE[n.a.mode]
    align = bool(n.a.align_corners)
    work = x if x.is_floating_point() else x.to(torch.float32)
    grid = grid.to(work.dtype)
    if mode == "bicubic" and n.a.padding_mode in ("border", "reflection"):
        grid = _pad_cubic_grid(grid, x.shape[2:], n.a.padding_mode, align)
    out = F.grid_sample(work, grid, mode=mode, padding_mode=n.a.padding_mode,
                        align_corners=align)
    return out.to(x.dtype)


@register(V.AffineGrid)
def affine_grid(n, theta, size):
    return F.affine_grid(theta, ints(size), align_corners=bool(n.a.align_corners))


# --- RoiAlign --------------------------------------------------------------------------------


def _roi_axis(start, bin_size, pooled: int, grid: int, limit: int):
    """Sample coordinates of one axis of one RoI: low/high taps, their weights and validity,
    each of shape (pooled * grid,), as the ONNX (and onnxruntime) RoiAlign defines them."""
    p = torch.arange(pooled, dtype=torch.float64)[:, None]
    i = torch.arange(grid, dtype=torch.float64)[None, :]
    c = (start + p * bin_size + (i + 0.5) * bin_size / grid).reshape(-1)
    valid = (c >= -1.0) & (c <= limit)
    c = c.clamp(min=0)
    low = c.floor().long()
    edge = low >= limit - 1
    low = torch.where(edge, limit - 1, low)
    high = torch.where(edge, low, low + 1)
    c = torch.where(edge, low.double(), c)
    lw = c - low
    return low, high, 1.0 - lw, lw, valid


def _roi_one(feat, box, a, half_pixel: bool):
    off = 0.5 if half_pixel else 0.0
    x0, y0, x1, y1 = (float(v) * a.spatial_scale - off for v in box)
    rw, rh = x1 - x0, y1 - y0
    if not half_pixel:
        rw, rh = max(rw, 1.0), max(rh, 1.0)
    ph, pw = a.output_height, a.output_width
    bh, bw = rh / ph, rw / pw
    gh = a.sampling_ratio if a.sampling_ratio > 0 else int(-(-rh // ph))
    gw = a.sampling_ratio if a.sampling_ratio > 0 else int(-(-rw // pw))
    gh, gw = max(int(gh), 0), max(int(gw), 0)
    H, W = feat.shape[-2:]
    yl, yh, why, wly, vy = _roi_axis(y0, bh, ph, gh, H)
    xl, xh, whx, wlx, vx = _roi_axis(x0, bw, pw, gw, W)
    valid = (vy[:, None] & vx[None, :]).to(feat.dtype)
    dt = feat.dtype
    corners = [(yl, xl, why, whx), (yl, xh, why, wlx), (yh, xl, wly, whx), (yh, xh, wly, wlx)]
    vals = [feat[:, ys[:, None], xs[None, :]] * (wy[:, None] * wx[None, :]).to(dt) * valid
            for ys, xs, wy, wx in corners]
    C = feat.shape[0]
    if a.mode == "max":
        v = torch.stack(vals).amax(0).reshape(C, ph, gh, pw, gw)
        return v.amax((2, 4))
    v = sum(vals).reshape(C, ph, gh, pw, gw)
    return v.sum((2, 4)) / max(gh * gw, 1)


@register(V.RoiAlign)
def roi_align(n, x, rois, batch_indices):
    a = n.a
    half_pixel = a.coordinate_transformation_mode == "half_pixel"
    bidx = ints(batch_indices)
    out = [_roi_one(x[b], rois[k].tolist(), a, half_pixel) for k, b in enumerate(bidx)]
    if not out:
        return x.new_zeros((0, x.shape[1], a.output_height, a.output_width))
    return torch.stack(out)


# --- NonMaxSuppression ---------------------------------------------------------------------


def _corners(boxes, center: bool):
    """Boxes as (y1, x1, y2, x2) with min <= max, from either ONNX box encoding."""
    if center:
        xc, yc, w, h = boxes.unbind(-1)
        return torch.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], -1)
    y1, x1, y2, x2 = boxes.unbind(-1)
    return torch.stack([torch.minimum(y1, y2), torch.minimum(x1, x2),
                        torch.maximum(y1, y2), torch.maximum(x1, x2)], -1)


def _iou(b):
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area[:, None] + area[None, :] - inter
    ok = (area[:, None] > 0) & (area[None, :] > 0) & (union > 0) & (inter > 0)
    return torch.where(ok, inter / torch.where(union > 0, union, torch.ones_like(union)),
                       torch.zeros_like(union))


def _nms_class(boxes, scores, limit: int, iou_th: float, score_th):
    keep = torch.arange(scores.shape[0])
    if score_th is not None:
        keep = keep[scores > score_th]
    order = keep[torch.sort(scores[keep], descending=True, stable=True).indices]
    iou = _iou(boxes[order].double())
    chosen: list[int] = []
    for i in range(order.shape[0]):
        if len(chosen) >= limit:
            break
        if all(float(iou[i, j]) <= iou_th for j in chosen):
            chosen.append(i)
    return order[chosen].tolist()


@register(V.NonMaxSuppression)
def non_max_suppression(n, boxes, scores, max_out=None, iou_th=None, score_th=None):
    limit = max(ints(max_out)[0], 0) if max_out is not None and max_out.numel() else 0
    iou = float(iou_th.reshape(-1)[0]) if iou_th is not None and iou_th.numel() else 0.0
    sth = float(score_th.reshape(-1)[0]) if score_th is not None and score_th.numel() else None
    rows = []
    for b in range(boxes.shape[0]):
        bx = _corners(boxes[b], bool(n.a.center_point_box))
        for c in range(scores.shape[1]):
            if limit == 0:
                continue
            rows += [(b, c, i) for i in _nms_class(bx, scores[b, c], limit, iou, sth)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
