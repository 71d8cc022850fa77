"""Triton INT8 GEMM for Int8MatMul: quantize, int8 tensor-core products, fused epilogue.

One kernel per layer: each program loads its tile of the float activation, quantizes it in
registers (``round(x / x_scale) + x_zero - 128`` as signed int8 codes), multiplies by the int8
weight with int32 accumulation (``tl.dot`` on int8 tensor cores), then dequantizes
(``* x_scale * w_scale[n]``, less ``(x_zero - 128) * colsum(W)[n]`` for an asymmetric zero
point), adds bias and residual, applies the activation and stores in the activation's dtype.
Tactic: ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}``. Runs on
CUDA, and anywhere under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import low_bit_cuda
from kiln.kernels.torch.int8 import _cached
from kiln.kernels.triton.common import (
    ACT_CODE,
    FLOATS,
    epilogue,
    grouped_tile,
    launch,
    on_device,
    tactic_of,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import int8 as I8


@jit
def _int8_gemm_kernel(X, W, Y, WS, CS, Bias, R, M, N, K, s_xm, s_xk, s_wk, s_wn, s_ym, s_yn,
                      s_rm, s_rn, x_scale, zshift, zint, act_a, act_b,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=rk[None, :] < left, other=0.0).to(tl.float32)
        q = tl.floor(x / x_scale + 0.5) + zshift
        q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int8)
        w = tl.load(w_ptrs, mask=rk[:, None] < left, other=0)  # masked k: weight 0
        acc += tl.dot(q, w, out_dtype=tl.int32)
        x_ptrs += BLOCK_K * s_xk
        w_ptrs += BLOCK_K * s_wk
    cols = rn < N
    corr = tl.load(CS + rn, mask=cols, other=0) * zint
    ws = tl.load(WS + rn, mask=cols, other=0.0)
    y = (acc - corr[None, :]).to(tl.float32) * (ws * x_scale)[None, :]
    mask = (rm[:, None] < M) & cols[None, :]
    y = epilogue(y, Bias, rn, N, R + rm[:, None].to(tl.int64) * s_rm + rn[None, :] * s_rn,
                 mask, act_a, act_b, HAS_BIAS, HAS_RES, ACT)
    tl.store(Y + rm[:, None].to(tl.int64) * s_ym + rn[None, :] * s_yn,
             y.to(Y.dtype.element_ty), mask=mask)


KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
_CONFIGS = ((128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3), (128, 128, 128, 8, 4, 4),
            (128, 128, 64, 8, 4, 4), (64, 128, 128, 8, 4, 4), (64, 64, 128, 8, 4, 4),
            (32, 64, 128, 8, 2, 5), (16, 64, 128, 8, 2, 4))
DEFAULT = dict(zip(KEYS, (64, 64, 64, 8, 4, 3)))


def _supports(n, inputs) -> bool:
    x, wq = inputs[0], inputs[1]
    return (on_device(*[t for t in inputs if t is not None]) and x.dtype in FLOATS
            and n.a.x_scale > 0.0 and x.dim() >= 2 and x.shape[-1] == wq.shape[0])


def _tactics(n, inputs) -> list[dict]:
    x, wq = inputs[0], inputs[1]
    m, nn = x.numel() // x.shape[-1], wq.shape[1]
    fits = [dict(zip(KEYS, c)) for c in _CONFIGS]
    fits = [t for t in fits if t["BLOCK_M"] <= max(16, 2 * m) and t["BLOCK_N"] <= max(16, 2 * nn)]
    return fits or [dict(DEFAULT)]


@register(I8.Int8MatMul, backend="cuda", name="TritonInt8MatMul", tactics=_tactics,
          supports=_supports)
def triton_int8_matmul(n, x, wq, w_scale, b=None, r=None):
    if not _supports(n, (x, wq, w_scale, b, r)):
        return low_bit_cuda.cuda_int8_matmul(n, x, wq, w_scale, b, r)
    a, t = n.a, tactic_of(n, DEFAULT)
    k, nn = wq.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, nn), dtype=x.dtype, device=x.device)
    r2 = None if r is None else r.reshape(m, nn)
    colsum = _cached(n, "colsum", lambda: wq.sum(0, dtype=torch.int32))
    grid = (cdiv(m, t["BLOCK_M"]) * cdiv(nn, t["BLOCK_N"]),)
    rs = r2.stride() if r2 is not None else (0, 0)
    launch(_int8_gemm_kernel, grid, x2, wq, y, w_scale, colsum, y if b is None else b,
           y if r2 is None else r2, m, nn, k, x2.stride(0), x2.stride(1), wq.stride(0),
           wq.stride(1), y.stride(0), y.stride(1), *rs, float(a.x_scale),
           float(a.x_zero - 128), int(a.x_zero - 128), float(a.alpha), float(a.beta),
           HAS_BIAS=b is not None,
           HAS_RES=r2 is not None, ACT=ACT_CODE[a.activation], BLOCK_M=t["BLOCK_M"],
           BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], GROUP_M=t["GROUP_M"],
           num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y.reshape(*x.shape[:-1], nn)
