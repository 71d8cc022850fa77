"""Kernels for the low-bit layers on CUDA (and FP8 everywhere): Int8MatMul by ``torch._int_mm``
(cuBLASLt int8 GEMM, int32 accumulation) and Fp8MatMul by ``torch._scaled_mm`` (FP8 e4m3
tensor cores, Hopper and newer), with the dequantize + bias + activation epilogue after. FP8
layers on other devices are emulated: the same float8 roundings, products in float32.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.fused_conv import epilogue
from kiln.kernels.torch.int8 import (
    E4M3_MAX,
    _cached,
    _int8_matmul_emulated,
    encode_out,
    float_dtype,
)
from kiln.ops import int8 as I8


def to_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` saturated to float8 e4m3; an e4m3 ``x`` is those codes already."""
    if x.dtype == torch.float8_e4m3fn:
        return x
    return torch.div(x.float(), scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _int_mm_ok(x2: torch.Tensor, wq: torch.Tensor) -> bool:
    m, (k, n) = x2.shape[0], wq.shape
    return x2.is_cuda and m > 16 and k % 8 == 0 and n % 8 == 0


@register(I8.Int8MatMul, backend="cuda", name="CudaInt8MatMul")
def cuda_int8_matmul(n, x, wq, w_scale, b=None, r=None):
    a = n.a
    k, m = wq.shape
    x2 = x.reshape(-1, k)
    if not _int_mm_ok(x2, wq):
        return _int8_matmul_emulated(n, x, wq, w_scale, b, r)
    # signed codes c - 128; an asymmetric zero point z adds (128 - z) * colsum(Wq)
    if x2.dtype == torch.int8:  # codes already (a quantized hand-off)
        xs = x2.contiguous()
    else:
        xs = torch.div(x2.float(), a.x_scale).round_().add_(a.x_zero - 128).clamp_(-128, 127)
        xs = xs.to(torch.int8)
    acc = torch._int_mm(xs, wq)
    if a.x_zero != 128:
        colsum = _cached(n, "colsum", lambda: wq.sum(0, dtype=torch.int32))
        acc = acc - (a.x_zero - 128) * colsum
    return _finish(acc.float().mul_(w_scale * a.x_scale), x, m, b, a, r)


def _finish(y, x, m: int, b, a, r, fp8: bool = False):
    """A GEMM's float32 rows ``y`` dequantized: + bias, back to ``x``'s leading dims and
    (float) dtype, then the layer's activation/residual epilogue, then its output codes
    where it hands off quantized."""
    if b is not None:
        y = y.add_(b)
    y = epilogue(y.reshape(*x.shape[:-1], m).to(float_dtype(a, x)), a, r)
    return encode_out(y, a, fp8)


def _fp8_emulated(n, x, wf8, w_scale, b, r):
    a = n.a
    xq = to_e4m3(x, a.x_scale).float() * a.x_scale
    y = torch.matmul(xq, wf8.float()) * w_scale
    if b is not None:
        y = y + b
    return encode_out(epilogue(y.to(float_dtype(a, x)), a, r), a, fp8=True)


@register(I8.Fp8MatMul)
def fp8_matmul(n, x, wf8, w_scale, b=None, r=None):
    return _fp8_emulated(n, x, wf8, w_scale, b, r)


def _scaled_mm_ok(x2, wf8) -> bool:
    if not (x2.is_cuda and torch.cuda.get_device_capability(x2.device) >= (8, 9)):
        return False
    k, n = wf8.shape
    return k % 16 == 0 and n % 16 == 0


@register(I8.Fp8MatMul, backend="cuda", name="CudaFp8MatMul")
def cuda_fp8_matmul(n, x, wf8, w_scale, b=None, r=None):
    a = n.a
    k, m = wf8.shape
    x2 = x.reshape(-1, k)
    if not _scaled_mm_ok(x2, wf8):
        return _fp8_emulated(n, x, wf8, w_scale, b, r)
    wt = _cached(n, "w_t", lambda: wf8.t().contiguous().t())  # column-major [K, N]
    one = _cached(n, "one", lambda: torch.ones((), device=x.device))
    sx = _cached(n, "sx", lambda: torch.tensor(a.x_scale, device=x.device))
    y = torch._scaled_mm(to_e4m3(x2, a.x_scale), wt, scale_a=sx, scale_b=one,
                         out_dtype=torch.bfloat16)
    return _finish(y.float().mul_(w_scale), x, m, b, a, r, fp8=True)
