"""Triton INT8 and FP8 GEMMs for Int8MatMul and Fp8MatMul: tensor-core products, fused epilogue.

One kernel per layer. Its X operand is either float (each program quantizes its tiles in
registers: ``round(x / x_scale) + x_zero - 128`` as signed int8 codes, or ``x / x_scale`` as
float8 e4m3) or the codes themselves, written by the layer that made X (a quantized hand-off,
:mod:`kiln.passes.quantize.handoff`): then the main loop is a plain 8-bit GEMM, both operands
loaded as bytes. The weight is stored K-major (``[K, N]`` with stride ``(1, K)``: Hopper's
8-bit tensor-core instructions read both operands K-major). Products accumulate in int32 (INT8)
or fp32 (FP8); the epilogue dequantizes (``* x_scale * w_scale[n]``, less ``(x_zero - 128) *
colsum(W)[n]`` for an asymmetric INT8 zero point), adds bias and residual, applies the
activation, and stores either the float result or, with ``out_scale``, the codes of the
layer that reads it (so the 8-bit activation is the only thing written).
Tactic: ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}``. Runs on
CUDA (FP8 from compute capability 8.9), and anywhere under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import low_bit_cuda
from kiln.kernels.torch.int8 import _cached, float_dtype
from kiln.kernels.triton.common import (
    ACT_CODE,
    FLOATS,
    INTERPRET,
    epilogue,
    grouped_tile,
    launch,
    on_device,
    quantize8,
    tactic_of,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import int8 as I8


@jit
def _q8_gemm_kernel(X, W, Y, WS, CS, Bias, R, M, N, K, s_xm, s_xk, s_wk, s_wn, s_ym, s_yn,
                    s_rm, s_rn, x_scale, zshift, zint, act_a, act_b, out_scale, out_shift,
                    FP8: tl.constexpr, X_CODES: tl.constexpr, OUT_CODES: tl.constexpr,
                    EXACT: tl.constexpr, EVEN_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    am, bn = rm % M, rn % N
    x_ptrs = X + am[:, None].to(tl.int64) * s_xm + rk[None, :] * s_xk
    w_ptrs = W + rk[:, None] * s_wk + bn[None, :].to(tl.int64) * s_wn
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # masked k: the weight is 0 there, so whatever X holds adds nothing
        if EVEN_K:
            xt = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        elif FP8:  # (an e4m3 load takes a float 'other', an int8 one an int)
            left = K - k * BLOCK_K
            xt = tl.load(x_ptrs, mask=rk[None, :] < left, other=0.0)
            w = tl.load(w_ptrs, mask=rk[:, None] < left, other=0.0)
        else:
            left = K - k * BLOCK_K
            xt = tl.load(x_ptrs, mask=rk[None, :] < left, other=0)
            w = tl.load(w_ptrs, mask=rk[:, None] < left, other=0)
        if X_CODES:
            q = xt
        else:
            q = quantize8(xt.to(tl.float32), x_scale, zshift, FP8, EXACT)
        if FP8:
            acc = tl.dot(q, w, acc)
        else:
            acc = tl.dot(q, w, acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K * s_xk
        w_ptrs += BLOCK_K * s_wk
    cols = rn < N
    ws = tl.load(WS + rn, mask=cols, other=0.0)
    if FP8:
        y = acc * (ws * x_scale)[None, :]
    else:
        corr = tl.load(CS + rn, mask=cols, other=0) * zint
        y = (acc - corr[None, :]).to(tl.float32) * (ws * x_scale)[None, :]
    mask = (rm[:, None] < M) & cols[None, :]
    y = epilogue(y, Bias, rn, N, R + rm[:, None].to(tl.int64) * s_rm + rn[None, :] * s_rn,
                 mask, act_a, act_b, HAS_BIAS, HAS_RES, ACT)
    y_ptrs = Y + rm[:, None].to(tl.int64) * s_ym + rn[None, :] * s_yn
    if OUT_CODES:
        tl.store(y_ptrs, quantize8(y, out_scale, out_shift, FP8, EXACT), mask=mask)
    else:
        tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
_CONFIGS = ((128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3), (128, 128, 128, 8, 4, 4),
            (128, 128, 128, 8, 8, 4), (128, 128, 64, 8, 4, 4), (64, 128, 128, 8, 4, 4),
            (128, 64, 128, 8, 4, 4), (64, 64, 128, 8, 4, 4), (32, 64, 128, 8, 2, 5),
            (16, 64, 128, 8, 2, 4))
DEFAULT = dict(zip(KEYS, (64, 64, 64, 8, 4, 3)))


def _codes_dtype(fp8: bool):
    return torch.float8_e4m3fn if fp8 else torch.int8


def _fp8_ok(x) -> bool:
    return INTERPRET or torch.cuda.get_device_capability(x.device) >= (8, 9)


def supports_q8(n, inputs, fp8: bool) -> bool:
    x, wq = inputs[0], inputs[1]
    ok_x = x.dtype in FLOATS or x.dtype == _codes_dtype(fp8)
    return (on_device(*[t for t in inputs if t is not None]) and ok_x and n.a.x_scale > 0.0
            and x.dim() >= 2 and wq.dim() == 2 and x.shape[-1] == wq.shape[0]
            and (not fp8 or _fp8_ok(x)))


def tactics_q8(n, inputs) -> list[dict]:
    """The tiles no more than twice the output's extent, of those the ones the FP16 GEMM's
    wave model rates best (each compiles a kernel per hand-off form at build)."""
    from kiln.kernels.triton.gemm import best_tiles

    x, wq = inputs[0], inputs[1]
    m, nn = x.numel() // x.shape[-1], wq.shape[1]
    fits = [dict(zip(KEYS, c)) for c in _CONFIGS]
    fits = [t for t in fits if t["BLOCK_M"] <= max(16, 2 * m) and t["BLOCK_N"] <= max(16, 2 * nn)]
    return best_tiles(fits, m, nn) or [dict(DEFAULT)]


def q8_matmul(n, x, wq, w_scale, b=None, r=None, fp8: bool = False):
    """``act(dequant(X @ Wq) + b + r)`` (or its codes, with ``out_scale``) in one launch."""
    a, t = n.a, tactic_of(n, DEFAULT)
    k, nn = wq.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    codes_out = a.out_scale > 0
    y = torch.empty((m, nn), dtype=_codes_dtype(fp8) if codes_out else float_dtype(a, x),
                    device=x.device)
    r2 = None if r is None else r.reshape(m, nn)
    wk = _cached(n, "w_kmajor", lambda: wq.t().contiguous().t())  # [K, N], stride (1, K)
    colsum = w_scale if fp8 else _cached(n, "colsum", lambda: wq.sum(0, dtype=torch.int32))
    grid = (cdiv(m, t["BLOCK_M"]) * cdiv(nn, t["BLOCK_N"]),)
    rs = r2.stride() if r2 is not None else (0, 0)
    zero = 128 if fp8 else a.x_zero
    launch(_q8_gemm_kernel, grid, x2, wk, y, w_scale, colsum, y if b is None else b,
           y if r2 is None else r2, m, nn, k, x2.stride(0), x2.stride(1), wk.stride(0),
           wk.stride(1), y.stride(0), y.stride(1), *rs, float(a.x_scale),
           float(zero - 128), int(zero - 128), float(a.alpha), float(a.beta),
           float(a.out_scale) if codes_out else 1.0, float(a.out_zero - 128),
           FP8=fp8, X_CODES=x.dtype == _codes_dtype(fp8), OUT_CODES=codes_out,
           EXACT=INTERPRET, EVEN_K=k % t["BLOCK_K"] == 0,
           HAS_BIAS=b is not None, HAS_RES=r2 is not None, ACT=ACT_CODE[a.activation],
           BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
           GROUP_M=t["GROUP_M"], num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y.reshape(*x.shape[:-1], nn)


# ---------------------------------------------------------------- the FP16 tactic

@jit
def _codes_kernel(X, Y, n_elems, scale, shift, FP8: tl.constexpr, X_CODES: tl.constexpr,
                  ENCODE: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    """Elementwise: ``ENCODE``: float -> codes; else codes (``X_CODES``) or float (through
    the quantizer) -> the dequantized float values ``(q - shift) * scale``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_elems
    if X_CODES:
        q = tl.load(X + offs, mask=m).to(tl.float32)
        tl.store(Y + offs, ((q - shift) * scale).to(Y.dtype.element_ty), mask=m)
    else:
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        q = quantize8(x, scale, shift, FP8, EXACT)
        if ENCODE:
            tl.store(Y + offs, q, mask=m)
        else:
            y = (q.to(tl.float32) - shift) * scale
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


def _codes_pass(x, out_dtype, scale: float, shift: int, fp8: bool, encode: bool, block=2048):
    """One elementwise pass of :func:`_codes_kernel` over ``x``'s memory (a dense x keeps
    its memory order: a channels-last map stays channels-last)."""
    if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(
            memory_format=torch.channels_last))):
        x = x.contiguous()
    y = torch.empty_like(x, dtype=out_dtype)
    launch(_codes_kernel, (cdiv(x.numel(), block),), x, y, x.numel(), float(scale),
           float(shift), FP8=fp8, X_CODES=x.dtype == _codes_dtype(fp8), ENCODE=encode,
           EXACT=INTERPRET, BLOCK=block, num_warps=4)
    return y


def _fp16_supports(n, inputs) -> bool:
    x, wq, _, b, r = (list(inputs) + [None] * 5)[:5]
    fp8 = wq.dtype == torch.float8_e4m3fn
    ft = float_dtype(n.a, x)
    out = (*x.shape[:-1], wq.shape[-1])
    return (on_device(*[t for t in inputs if t is not None]) and ft in (torch.float16,
                                                                          torch.bfloat16)
            and (x.dtype == ft or x.dtype == _codes_dtype(fp8)) and n.a.x_scale > 0
            and x.dim() >= 2 and wq.dim() == 2 and x.shape[-1] == wq.shape[0]
            and x.numel() > 0 and (b is None or (b.numel() == wq.shape[1] and b.dtype == ft))
            and (r is None or (tuple(r.shape) == out and r.dtype == ft)))


def _fp16_tactics(n, inputs) -> list[dict]:
    from kiln.kernels.triton.gemm import CUBLAS_TACTICS, gemm_tactics

    x, wq = inputs[0], inputs[1]
    return gemm_tactics(x.numel() // x.shape[-1], wq.shape[1], x.shape[-1]) + [
        dict(t) for t in CUBLAS_TACTICS]


def _fp16_plan(t) -> str | None:
    return "cublas" if t and t.get("impl") == "cublas" else None


def fp16_q8_matmul(n, x, wq, w_scale, b=None, r=None):
    """The layer by an FP16 GEMM (kiln's Triton tiles or cuBLAS, as FusedMatMul runs): its
    input through the same quantizer (or its codes decoded) in one pass, the weight
    dequantized once to FP16, the output encoded where the layer hands off codes. The same
    function as the 8-bit kernels to FP16 rounding; the autotuner times it beside them, so
    a layer whose 8-bit kernel is slower keeps FP16 speed."""
    from kiln.kernels.triton.gemm import _matmul

    a = n.a
    fp8 = wq.dtype == torch.float8_e4m3fn
    ft = float_dtype(a, x)
    shift = 0 if fp8 else a.x_zero - 128
    xf = _codes_pass(x, ft, a.x_scale, shift, fp8, encode=False)
    w = _cached(n, ("w_dequantized", ft), lambda: (wq.float() * w_scale).to(ft))
    y = _matmul(n, xf, w, b, r, a.activation, a.alpha, a.beta)
    if a.out_scale > 0:
        y = _codes_pass(y, _codes_dtype(fp8), a.out_scale, 0 if fp8 else a.out_zero - 128,
                        fp8, encode=True)
    return y


def _supports_int8(n, inputs) -> bool:
    return supports_q8(n, inputs, False)


def _supports_fp8(n, inputs) -> bool:
    return supports_q8(n, inputs, True)


@register(I8.Int8MatMul, backend="cuda", name="TritonInt8MatMul", tactics=tactics_q8,
          supports=_supports_int8)
def triton_int8_matmul(n, x, wq, w_scale, b=None, r=None):
    if not _supports_int8(n, (x, wq, w_scale, b, r)):
        return low_bit_cuda.cuda_int8_matmul(n, x, wq, w_scale, b, r)
    return q8_matmul(n, x, wq, w_scale, b, r, fp8=False)


@register(I8.Fp8MatMul, backend="cuda", name="TritonFp8MatMul", tactics=tactics_q8,
          supports=_supports_fp8)
def triton_fp8_matmul(n, x, wf8, w_scale, b=None, r=None):
    if not _supports_fp8(n, (x, wf8, w_scale, b, r)):
        return low_bit_cuda.cuda_fp8_matmul(n, x, wf8, w_scale, b, r)
    return q8_matmul(n, x, wf8, w_scale, b, r, fp8=True)


# after the 8-bit kernels: the default (first) CUDA kernel of an untuned build is theirs
register(I8.Int8MatMul, I8.Fp8MatMul, backend="cuda", name="Fp16Q8MatMul",
         tactics=_fp16_tactics, supports=_fp16_supports, makes_plan=_fp16_plan)(fp16_q8_matmul)
