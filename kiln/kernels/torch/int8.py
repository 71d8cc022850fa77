"""PyTorch kernels: Int8MatMul and Int8Conv (kiln.ops.int8).

On the CPU both run oneDNN's u8s8 kernels through PyTorch (``onednn::qlinear_pointwise``,
``onednn::qconv2d_pointwise``): the activation is quantized to uint8 codes, the products
accumulate in int32, and dequantize + bias + activation run as oneDNN post-ops (a residual is
added after, then the activation). The weight is reordered into oneDNN's layout on the first
call and kept. Elsewhere (CUDA, or a PyTorch without oneDNN's ops) the same arithmetic is
emulated in float: exact integer codes, products summed in float32.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.fused_conv import _ONEDNN_ACT, _TORCH_ACT, epilogue, symmetric_geometry
from kiln.ops import int8 as I8

_HAS_ONEDNN = hasattr(torch.ops.onednn, "qlinear_pointwise") and \
    torch.backends.mkldnn.is_available()
_LOCK = threading.Lock()


def quantize_u8(x: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
    """uint8 codes ``clamp(round(x / scale) + zero, 0, 255)`` (round half to even)."""
    y = torch.div(x, scale)
    return y.round_().add_(zero).clamp_(0, 255).to(torch.uint8)


def _onednn(x: torch.Tensor) -> bool:
    return _HAS_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32


def _cpu_half(x: torch.Tensor) -> bool:
    """An FP16/BF16 build's INT8 layer on the CPU: oneDNN in float32, cast back."""
    return _HAS_ONEDNN and x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16)


def _cached(n, key, make):
    """A per-node value made once (the packed weight)."""
    v = n.cache.get(key)
    if v is None:
        with _LOCK:
            v = n.cache.get(key)
            if v is None:
                v = n.cache[key] = make()
    return v


def _post_op(a, r):
    """oneDNN's post-op for the epilogue, when it can run there (no residual)."""
    if r is None:
        attr, scalars, algo = _ONEDNN_ACT[a.activation]
        return attr, scalars(a), algo, False
    return "none", [], "", True


def dynamic_range(x: torch.Tensor) -> tuple[float, int]:
    """(scale, uint8 zero) from x's own range, which always holds 0 (DynamicQuantizeLinear)."""
    lo, hi = torch.aminmax(x)
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    return scale, int(min(255, max(0, round(-lo / scale))))


@register(I8.Int8MatMul)
def int8_matmul(n, x, wq, w_scale, b=None, r=None):
    a = n.a
    if a.x_scale == 0.0:  # dynamic: this call's own range
        s, z = dynamic_range(x)
        a = dataclasses.replace(a, x_scale=s, x_zero=z)
        n = _WithAttrs(n, a)
    if _cpu_half(x):
        b, r = (None if t is None else t.float() for t in (b, r))
        return int8_matmul(n, x.float(), wq, w_scale, b, r).to(x.dtype)
    k, m = wq.shape
    if not _onednn(x):
        return _int8_matmul_emulated(n, x, wq, w_scale, b, r)
    x2 = x.reshape(-1, k)
    packed = _cached(n, "w_packed", lambda: torch.ops.onednn.qlinear_prepack(
        wq.t().contiguous(), None))
    zeros = _cached(n, "w_zero", lambda: torch.zeros(m, dtype=torch.long))
    attr, scalars, algo, after = _post_op(a, r)
    y = torch.ops.onednn.qlinear_pointwise(
        quantize_u8(x2, a.x_scale, a.x_zero), a.x_scale, a.x_zero, packed, w_scale, zeros, b,
        1.0, 0, torch.float32, attr, scalars, algo)
    y = y.reshape(*x.shape[:-1], m)
    return epilogue(y, a, r) if after else y


class _WithAttrs:
    """A node's call seen with other attributes (a dynamic layer's per-call scale)."""

    def __init__(self, call, attrs):
        self.call, self.a = call, attrs

    @property
    def cache(self):
        return self.call.cache


def dequantize_codes(x, a) -> torch.Tensor:
    """``x`` through the quantizer and back: what an INT8 layer sees of its input."""
    q = torch.clamp(torch.round(torch.div(x.float(), a.x_scale)) + a.x_zero, 0, 255)
    return q - a.x_zero


def _int8_matmul_emulated(n, x, wq, w_scale, b, r):
    a = n.a
    y = torch.matmul(dequantize_codes(x, a), wq.float()) * (w_scale * a.x_scale)
    if b is not None:
        y = y + b
    return epilogue(y.to(x.dtype), a, r)


@register(I8.Int8Conv)
def int8_conv(n, x, wq, w_scale, b=None, r=None):
    a = n.a
    geo = symmetric_geometry(n, x, wq) if x.dim() == 4 else None
    if not _onednn(x) or geo is None:
        return _int8_conv_emulated(n, x, wq, w_scale, b, r)
    pad, stride, dil, _ = geo
    groups = a.group or 1
    packed = _cached(n, "w_packed", lambda: torch.ops.onednn.qconv_prepack(
        wq.contiguous(), w_scale, a.x_scale, a.x_zero, stride, pad, dil, groups, None))
    zeros = _cached(n, "w_zero", lambda: torch.zeros(wq.shape[0], dtype=torch.long))
    attr, scalars, algo, after = _post_op(a, r)
    xq = quantize_u8(x.contiguous(memory_format=torch.channels_last), a.x_scale, a.x_zero)
    y = torch.ops.onednn.qconv2d_pointwise(
        xq, a.x_scale, a.x_zero, packed, w_scale, zeros, b, stride, pad, dil, groups, 1.0, 0,
        torch.float32, attr, scalars, algo or None)
    return epilogue(y, a, r) if after else y


def _int8_conv_emulated(n, x, wq, w_scale, b, r):
    from kiln.kernels.torch.quant_linear import conv_nd

    a = n.a
    y = conv_nd(dequantize_codes(x, a), wq.float(), None, a)
    y = y * (w_scale * a.x_scale).reshape((1, -1) + (1,) * (y.dim() - 2))
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * (y.dim() - 2))
    y = y.to(x.dtype)
    if r is not None:
        y = y + r
    return _TORCH_ACT[a.activation](y, a)
