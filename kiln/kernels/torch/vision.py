"""PyTorch kernels: vision ops (Resize and Upsample here; sampling, RoiAlign and NMS in
vision_sample.py, imported at the bottom so registration happens with this module)."""

from __future__ import annotations

import math

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.util import ints
from kiln.ops import vision as V
from kiln.ops.vision import resize_out_shape

# Resize works separably: one axis at a time, each output position a weighted sum of a few
# input taps. Coordinates and weights are computed in float64 (they are tiny: one row per
# output position) so they match the ONNX definition bit for bit; the data stays in its dtype.


def _source_coords(mode: str, y, scale: float, in_w: int, out_w: int, roi):
    """Map output indices ``y`` to input coordinates per ``coordinate_transformation_mode``;
    also returns the mask of positions to extrapolate (tf_crop_and_resize only)."""
    out_f = scale * in_w
    if mode == "align_corners":
        x = torch.zeros_like(y) if out_f == 1 else y * (in_w - 1) / (out_f - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi
        if out_f == 1:
            x = torch.full_like(y, (hi - lo) * (in_w - 1) / 2)
        else:
            x = y * (hi - lo) * (in_w - 1) / (out_f - 1)
        x = x + lo * (in_w - 1)
        return x, (x < 0) | (x > in_w - 1)
    elif mode == "pytorch_half_pixel":
        x = torch.full_like(y, -0.5) if out_f == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        offset = in_w / 2 * (1 - out_w / out_f)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ValueError(f"Resize: unknown coordinate_transformation_mode {mode!r}")
    return x, None


def _cubic(x, a: float):
    """The cubic convolution kernel with coefficient ``a`` at distances ``x``."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _weights(mode: str, ratio, scale: float, antialias: bool, cubic_a: float):
    """Per-output tap weights, shape (out_w, n); ``ratio`` in (0, 1] is the distance of the
    source coordinate past its left tap."""
    r = ratio[:, None]
    if mode == "linear" and antialias and scale < 1:
        start = math.floor(-1 / scale) + 1
        taps = torch.arange(start, 2 - start, dtype=torch.float64)
        w = (1 - ((taps - r) * scale).abs()).clamp(0, 1)
        return w / w.sum(-1, keepdim=True)
    if mode == "linear":
        return torch.cat([1 - r, r], -1)
    if mode == "cubic" and antialias and scale < 1:
        start = math.floor(-2 / scale) + 1
        taps = torch.arange(start, 2 - start, dtype=torch.float64)
        w = _cubic((taps - r) * scale, cubic_a)
        return w / w.sum(-1, keepdim=True)
    if mode == "cubic":
        taps = torch.arange(-1, 3, dtype=torch.float64)
        return _cubic(taps - r, cubic_a)
    raise ValueError(f"Resize: unknown mode {mode!r}")


def _taps(x, n: int):
    """Index of the first of the ``n`` input taps nearest to ``x`` (ties to the left), as the
    ONNX reference picks them."""
    pad = math.ceil(n / 2)
    xp = x + pad
    p = torch.floor(xp)
    frac = xp - p
    if n % 2 == 0:
        off = torch.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        off = torch.where(frac <= 0.5, base, base + 1)
    return (p + off).long() - pad


def _nearest_index(x, nearest_mode: str):
    fl = torch.floor(x)
    frac = x - fl
    if nearest_mode == "round_prefer_floor":
        up = frac > 0.5
    elif nearest_mode == "round_prefer_ceil":
        up = frac >= 0.5
    elif nearest_mode == "floor":
        up = torch.zeros_like(frac, dtype=torch.bool)
    elif nearest_mode == "ceil":
        up = frac > 0
    else:
        raise ValueError(f"Resize: unknown nearest_mode {nearest_mode!r}")
    return fl.long() + up.long()


def _resize_axis(x, axis: int, scale: float, out_w: int, roi, opts: dict):
    in_w = x.shape[axis]
    y = torch.arange(out_w, dtype=torch.float64)
    src, extrap = _source_coords(opts["coord"], y, scale, in_w, out_w, roi)
    if opts["mode"] == "nearest":
        idx = _nearest_index(src, opts["nearest_mode"]).clamp(0, in_w - 1)
        out = x.index_select(axis, idx)
    else:
        fl = torch.floor(src)
        ratio = torch.where(src == fl, torch.ones_like(src), src - fl)
        w = _weights(opts["mode"], ratio, scale, opts["antialias"], opts["cubic_a"])
        n = w.shape[1]
        idx = _taps(src, n)[:, None] + torch.arange(n)
        if opts["exclude_outside"]:
            w = torch.where((idx < 0) | (idx >= in_w), torch.zeros_like(w), w)
            s = w.sum(-1, keepdim=True)
            w = w / torch.where(s == 0, torch.ones_like(s), s)
        g = x.index_select(axis, idx.clamp(0, in_w - 1).reshape(-1))
        g = g.reshape(x.shape[:axis] + (out_w, n) + x.shape[axis + 1:])
        wshape = (out_w, n) + (1,) * (x.dim() - axis - 1)
        out = (g * w.to(x.dtype).reshape(wshape)).sum(axis + 1)
    if extrap is not None and bool(extrap.any()):
        mshape = (out_w,) + (1,) * (x.dim() - axis - 1)
        out = out.masked_fill(extrap.reshape(mshape), opts["extrapolation"])
    return out


def resize(x, scales, sizes, roi, axes, opts: dict):
    """Resize ``x`` given per-axis ``scales`` or ``sizes`` (over ``axes``), as ONNX defines."""
    r = x.dim()
    axes = [a + r if a < 0 else a for a in (axes or range(r))]
    shape = list(x.shape)
    if sizes is not None:
        out = resize_out_shape(shape, axes, sizes=sizes, policy=opts["policy"])
        full = [out[i] / shape[i] if shape[i] else 1.0 for i in range(r)]
        if opts["policy"] in ("not_larger", "not_smaller"):
            ratios = [sizes[k] / shape[a] for k, a in enumerate(axes)]
            s = min(ratios) if opts["policy"] == "not_larger" else max(ratios)
            full = [s if i in axes else 1.0 for i in range(r)]
    else:
        full = [1.0] * r
        for a, s in zip(axes, scales):
            full[a] = s
        out = [math.floor(full[i] * shape[i]) for i in range(r)]
    rois = {}
    if opts["coord"] == "tf_crop_and_resize" and roi:
        k = len(roi) // 2
        roi_axes = axes if k == len(axes) else list(range(r))
        for j, a in enumerate(roi_axes):
            rois[a] = (roi[j], roi[k + j])
    fast = _interpolate(x, shape, out, full, rois, opts)
    if fast is not None:
        return fast
    work = x if x.is_floating_point() else x.to(torch.float32)
    for a in axes:
        lohi = rois.get(a, (0.0, 1.0))
        if full[a] == 1.0 and out[a] == shape[a] and lohi == (0.0, 1.0):
            continue
        work = _resize_axis(work, a, full[a], out[a], lohi, opts)
    if work.dtype != x.dtype:
        info = torch.iinfo(x.dtype) if x.dtype != torch.bool else None
        work = work.round()
        if info is not None:
            work = work.clamp(info.min, info.max)
        work = work.to(x.dtype)
    return work


# (mode, coordinate_transformation_mode) -> F.interpolate's mode and align_corners, where its
# source coordinates are ONNX's: bilinear half_pixel (torch clamps a negative source to 0,
# which is what ONNX's clamped taps give), align_corners, and nearest asymmetric floor
_INTERPOLATE = {("linear", "half_pixel"): ("bilinear", False),
                ("linear", "pytorch_half_pixel"): ("bilinear", False),
                ("linear", "align_corners"): ("bilinear", True),
                ("nearest", "asymmetric"): ("nearest", None)}


def _interpolate(x, shape, out, full, rois, opts):
    """The resize of H and W of a 4-D float tensor by ``F.interpolate`` (one pass, ~20x faster
    than the separable gather on a [1, 21, 40, 40] -> 320 x 320 upsample) where its
    arithmetic is ONNX's: the modes of :data:`_INTERPOLATE`, sizes whose ratio is the scale
    (so torch's in/out is ONNX's 1/scale), no antialias or exclude_outside; else None."""
    key = (opts["mode"], opts["coord"])
    if key not in _INTERPOLATE or x.dim() != 4 or not x.is_floating_point() or rois \
            or opts["antialias"] or opts["exclude_outside"] or out[:2] != shape[:2] \
            or (opts["mode"] == "nearest" and opts["nearest_mode"] != "floor") \
            or min(shape[2:]) < 1 or min(out[2:]) < 2:  # (pytorch_half_pixel's size-1 rule)
        return None
    if any(full[a] != out[a] / shape[a] for a in (2, 3)):
        return None
    if opts["mode"] == "nearest" and any(  # torch's float32 in/out is exact: factors 2^k
            out[a] % shape[a] or (out[a] // shape[a]) & (out[a] // shape[a] - 1)
            for a in (2, 3)):
        return None
    mode, corners = _INTERPOLATE[key]
    if mode == "bilinear" and _native_linear(x):  # resize.c: F.interpolate's values, 2.5-3x
        # faster on LR-ASPP's [1, 21, 40, 40] -> 320 x 320 (1 thread: 1141 -> 415 us
        # channels-last, 2682 -> 949 NCHW)
        from kiln import native

        return native.resize_linear2d(x, tuple(out[2:]), corners)
    return torch.nn.functional.interpolate(x, size=tuple(out[2:]), mode=mode,
                                           align_corners=corners)


def _native_linear(x) -> bool:
    """Whether resize.c takes this bilinear resize: a float32 CPU tensor, contiguous or
    channels-last, with the native library built."""
    from kiln import native

    return native.available and x.dtype == torch.float32 and x.device.type == "cpu" and (
        x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))


def _floats(t) -> list[float]:
    if t is None:
        return []
    return [float(v) for v in t.reshape(-1).tolist()]


@register(V.Resize)
def resize_kernel(n, x, *rest):
    a = n.a
    if n.n_in == 2:  # opset 10: Resize(X, scales), the Upsample semantics
        roi, scales, sizes = None, _floats(rest[0]), None
        coord, nearest = "asymmetric", "floor"
    else:
        roi = _floats(rest[0]) if rest else None
        scales = _floats(rest[1]) if len(rest) > 1 else []
        sizes = ints(rest[2]) if len(rest) > 2 and rest[2] is not None else []
        coord, nearest = a.coordinate_transformation_mode, a.nearest_mode
    if sizes:
        scales = None
    elif not scales:
        raise ValueError("Resize needs one of scales or sizes")
    else:
        sizes = None
    opts = {"mode": a.mode, "coord": coord, "nearest_mode": nearest,
            "antialias": bool(a.antialias), "cubic_a": a.cubic_coeff_a,
            "exclude_outside": bool(a.exclude_outside), "extrapolation": a.extrapolation_value,
            "policy": a.keep_aspect_ratio_policy}
    return resize(x, scales, sizes, roi, list(a.axes) if a.axes else None, opts)


@register(V.Upsample)
def upsample_kernel(n, x, scales=None):
    a = n.a
    if scales is not None:
        sc = _floats(scales)
    elif a.scales is not None:
        sc = list(a.scales)
    else:  # opset 1: height_scale / width_scale on the last two axes
        sc = [1.0] * (x.dim() - 2) + [a.height_scale, a.width_scale]
    mode = "linear" if a.mode in ("linear", "bilinear") else a.mode
    opts = {"mode": mode, "coord": "asymmetric", "nearest_mode": "floor", "antialias": False,
            "cubic_a": -0.75, "exclude_outside": False, "extrapolation": 0.0,
            "policy": "stretch"}
    return resize(x, sc, None, None, None, opts)
