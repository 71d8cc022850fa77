"""Triton GEMM with a fused epilogue: ``act(alpha * A @ B + bias + residual)``.

fp16/bf16 inputs, fp32 accumulation, the output in the input dtype. A and B are read through
their strides, so transposed operands (Gemm's transA/transB, a weight stored [N, K]) cost no
copy. Tactic: ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps",
"num_stages"}``; with SPLIT_K > 1 each K slice writes an fp32 partial and a second kernel sums
the slices and applies the epilogue. Registered for MatMul, Gemm, FusedMatMul and FusedGemm;
anything else (fp32, integer, batched B, odd residual shapes) runs the PyTorch kernel.

FusedMatMul with an activation or a residual also has ``{"impl": "cublas", "BLOCK",
"num_warps"}``: cuBLAS(Lt) computes ``x @ w + bias`` (the bias in its epilogue) and one Triton
pass applies the residual and the activation in place. At large batches cuBLAS's GEMMs beat
this module's (BERT-base b64 on the H200: 2.1 against 3.3 ms over 48 products), and PyTorch's
own GELU pass after them ran at a third of the memory bandwidth (0.42 ms over 12 layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.kernels.torch import fused_conv as torch_fused
from kiln.kernels.torch import nn_norm as torch_nn
from kiln.kernels.triton.common import (
    ACT_CODE,
    FLOATS,
    HALF,
    act,
    epilogue,
    grouped_tile,
    launch,
    next_pow2,
    on_device,
    rows_act_,
    tactic_of,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.kernels.triton.norm import norm_rows, row_tiles
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N


@jit
def _gemm_kernel(A, B, C, Bias, R, P, M, N, K,
                 s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_rm, s_rn, alpha, act_a, act_b,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    # out-of-range rows/cols read a valid row instead (masked on store): unmasked wide loads
    am = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    bn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    a_ptrs = A + am[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_ptrs = B + rk[:, None] * s_bk + bn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step = BLOCK_K * SPLIT_K
    for k in range(0, tl.cdiv(K, step)):
        k_left = K - k * step
        a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += step * s_ak
        b_ptrs += step * s_bk
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        y = epilogue(acc * alpha, Bias, rn, N,
                     R + rm[:, None].to(tl.int64) * s_rm + rn[None, :] * s_rn, mask, act_a,
                     act_b, HAS_BIAS, HAS_RES, ACT)
        c_ptrs = C + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c_ptrs, y.to(C.dtype.element_ty), mask=mask)
    else:
        p_ptrs = P + pid_k * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(p_ptrs, acc, mask=mask)


@jit
def splitk_epilogue(P, C, Bias, R, M, N, s_cm, s_cn, s_rm, s_rn, alpha, act_a, act_b,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    m, n = idx // N, idx % N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(P + s * M * N + idx, mask=mask, other=0.0)
    acc = acc * alpha
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(R + m * s_rm + n * s_rn, mask=mask, other=0.0).to(tl.float32)
    acc = act(acc, ACT, act_a, act_b)
    tl.store(C + m * s_cm + n * s_cn, acc.to(C.dtype.element_ty), mask=mask)


KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages")
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages): the configs Triton's
# tutorial and inductor's mm templates start from, plus small-M and split-K shapes
_CONFIGS = (
    (128, 256, 64, 8, 1, 8, 3), (256, 128, 64, 8, 1, 8, 3), (128, 128, 64, 8, 1, 4, 4),
    (128, 128, 32, 8, 1, 4, 4), (128, 64, 64, 8, 1, 4, 4), (64, 128, 64, 8, 1, 4, 4),
    (64, 64, 64, 8, 1, 4, 4), (64, 64, 32, 8, 1, 2, 5), (32, 64, 64, 8, 1, 2, 5),
    (16, 64, 128, 8, 1, 2, 4), (16, 128, 64, 8, 1, 4, 4), (32, 128, 64, 8, 1, 4, 4),
    (64, 64, 64, 8, 2, 4, 4), (64, 64, 64, 8, 4, 4, 4), (32, 64, 128, 8, 4, 4, 3),
    (128, 128, 64, 8, 2, 8, 3),
)
DEFAULT = dict(zip(KEYS, (64, 64, 32, 8, 1, 4, 3)))


SMS = 132  # an H100/H200's SM count
TILE_KEEP = 5  # tile configs per product that reach the autotuner


def gemm_tactics(m: int, n: int, k: int) -> list[dict]:
    """The configs worth timing for an M x N x K product: no tile more than twice the
    problem, split-K only when K is long and the output tiles too few to fill the GPU, no more
    pipeline stages than K steps (ResNet's 64-channel 1x1 convs: memory-bound products whose
    programs per SM the unused stages' shared memory capped at one); of those, the
    :func:`best_tiles`."""
    out = []
    for t in fitting_tiles(_CONFIGS, m, n):
        if t["SPLIT_K"] > 1 and (k < 1024 or tile_count(t, m, n) >= 128):
            continue
        # no more stages than K steps: a stage past them loads nothing, but still holds its
        # tiles' shared memory (H200, 128x128x64 tile: 32 KB at one stage, 128 KB at four)
        t["num_stages"] = max(1, min(t["num_stages"], -(-k // (t["BLOCK_K"] * t["SPLIT_K"]))))
        if t not in out:
            out.append(t)
    return best_tiles(out, m, n) or [dict(DEFAULT)]


def best_tiles(tactics: list[dict], m: int, n: int, keep: int = TILE_KEEP) -> list[dict]:
    """The ``keep`` tiles a wave model rates best for an [m, n] output: the useful share of
    the work launched (``m * n`` over waves x SMs x tile area, so padded tiles and a last
    wave that leaves SMs idle both count against a tile), times a small bonus for larger
    tiles (more reuse per loaded element). Each tactic compiles its own kernel (60-300 ms) and
    is timed; the others were rarely within a few percent of the best. Order is kept."""
    if len(tactics) <= keep:
        return list(tactics)

    def score(t: dict) -> float:
        tiles = tile_count(t, m, n) * t.get("SPLIT_K", 1)
        waves = -(-tiles // SMS)
        useful = m * n / (waves * SMS * t["BLOCK_M"] * t["BLOCK_N"])
        return min(useful * t.get("SPLIT_K", 1), 1.0) * (t["BLOCK_M"] * t["BLOCK_N"]) ** 0.15

    ranked = sorted(range(len(tactics)), key=lambda i: (-score(tactics[i]), i))[:keep]
    return [tactics[i] for i in sorted(ranked)]


def fitting_tiles(configs, m: int, n: int) -> list[dict]:
    """``configs`` (tuples in KEYS order) as tactics, less those with a tile more than twice
    the [m, n] output's extent."""
    return [t for t in (dict(zip(KEYS, c)) for c in configs)
            if t["BLOCK_M"] <= max(16, 2 * m) and t["BLOCK_N"] <= max(16, 2 * n)]


def tile_count(t: dict, m: int, n: int) -> int:
    return -(-m // t["BLOCK_M"]) * -(-n // t["BLOCK_N"])


def gemm2d(n, a, b, bias=None, res=None, activation: str = "", alpha: float = 1.0,
           act_a: float = 0.0, act_b: float = 0.0):
    """``act(alpha * a @ b + bias + res)`` for 2-D strided a [M, K], b [K, N]; res [M, N]."""
    (m, k), nn = a.shape, b.shape[1]
    t = tactic_of(n, DEFAULT)
    c = torch.empty((m, nn), dtype=a.dtype, device=a.device)
    split = t["SPLIT_K"]
    p = torch.empty((split, m, nn), dtype=torch.float32, device=a.device) if split > 1 else c
    dummy = c
    grid = (cdiv(m, t["BLOCK_M"]) * cdiv(nn, t["BLOCK_N"]), split)
    codes = dict(HAS_BIAS=bias is not None, HAS_RES=res is not None,
                 ACT=ACT_CODE[activation])
    rs = res.stride() if res is not None else (0, 0)
    launch(_gemm_kernel, grid, a, b, c, dummy if bias is None else bias,
           dummy if res is None else res, p, m, nn, k,
           a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), *rs,
           float(alpha), float(act_a), float(act_b), **codes,
           BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
           GROUP_M=t["GROUP_M"], SPLIT_K=split, num_warps=t["num_warps"],
           num_stages=t["num_stages"])
    if split > 1:
        block = 1024
        launch(splitk_epilogue, (cdiv(m * nn, block),), p, c,
               dummy if bias is None else bias, dummy if res is None else res, m, nn,
               c.stride(0), c.stride(1), *rs, float(alpha), float(act_a), float(act_b),
               **codes, SPLIT_K=split, BLOCK=block, num_warps=4)
    return c


# ---------------------------------------------------------------- the ops


def _halves(*ts) -> bool:
    ts = [t for t in ts if t is not None]
    return on_device(*ts) and ts[0].dtype in HALF and all(t.dtype == ts[0].dtype for t in ts)


def _bias_ok(bias, nn: int) -> bool:
    return bias is None or (bias.numel() == nn and bias.dim() >= 1 and bias.shape[-1] == nn)


def _mm_shapes(n, inputs):
    x, w = inputs[0], inputs[1]
    return x.reshape(-1, x.shape[-1]).shape[0], w.shape[-1], x.shape[-1]


def _matmul_supports(n, inputs) -> bool:
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    res = inputs[3] if len(inputs) > 3 else None
    if not (_halves(x, w, bias, res) and x.dim() >= 2 and w.dim() == 2
            and x.shape[-1] == w.shape[0] and x.numel() > 0 and w.shape[1] > 0):
        return False
    out = (*x.shape[:-1], w.shape[1])
    return _bias_ok(bias, w.shape[1]) and (res is None or tuple(res.shape) == out)


# cuBLAS, then the Triton epilogue pass over the output: over [rows, last dim] tiles, or
# ("flat") over the output as one run of elements (no lanes idle where a row, BERT's 3072,
# is not a power of two wide)
CUBLAS_TACTICS = ({"impl": "cublas", "BLOCK": 2048, "num_warps": 4},
                  {"impl": "cublas", "BLOCK": 4096, "num_warps": 8},
                  {"impl": "cublas", "BLOCK": 4096, "num_warps": 8, "flat": 1})
# cuBLASLt's own epilogues (torch._addmm_activation): bias + ReLU, or bias + GELU's tanh form,
# in the GEMM itself, no pass over the output. cuBLASLt has no erf GELU, so an exact Gelu
# (BERT's) keeps the pass above or the Triton tile's fused epilogue; its tanh form is a
# different function (|diff| up to 4.7e-4), not substituted for it.
LT_ACTS = {"Relu": False, "GeluTanh": True}  # activation -> _addmm_activation's use_gelu
CUBLASLT_TACTIC = {"impl": "cublaslt"}


def lt_fuses(activation: str, bias, res) -> bool:
    """Can cuBLASLt's epilogue compute ``act(x @ w + bias)`` whole? (A residual would have to
    be added before the activation: no.)"""
    return activation in LT_ACTS and bias is not None and res is None


def _matmul_tactics(n, inputs) -> list[dict]:
    tiles = gemm_tactics(*_mm_shapes(n, inputs))
    bias = inputs[2] if len(inputs) > 2 else None
    res = inputs[3] if len(inputs) > 3 else None
    activation = getattr(n.a, "activation", "")
    out = tiles + ([dict(t) for t in CUBLAS_TACTICS] if activation or res is not None else [])
    return out + ([dict(CUBLASLT_TACTIC)] if lt_fuses(activation, bias, res) else [])


def _matmul_plan(t) -> str | None:
    return "cublas" if t and t.get("impl") in ("cublas", "cublaslt") else None


def _matmul(n, x, w, bias=None, res=None, activation="", act_a=0.0, act_b=0.0):
    x2 = x.reshape(-1, x.shape[-1])
    r2 = None if res is None else res.reshape(-1, w.shape[1])
    b1 = None if bias is None else bias.reshape(-1)
    t = getattr(n, "tactic", None) or {}
    if t.get("impl") == "cublaslt" and lt_fuses(activation, b1, r2):
        y = torch._addmm_activation(b1, x2, w, use_gelu=LT_ACTS[activation])
    elif t.get("impl") == "cublas" and (r2 is None or r2.is_contiguous()):
        y = F.linear(x2, w.t(), b1)
        rows_act_(y, r2, activation, act_a, act_b, t["BLOCK"], t["num_warps"],
                  flat=bool(t.get("flat")))
    else:
        y = gemm2d(n, x2, w, b1, r2, activation, 1.0, act_a, act_b)
    return y.reshape(*x.shape[:-1], w.shape[1])


@register(N.MatMul, backend="cuda", name="TritonMatMul", tactics=_matmul_tactics,
          supports=_matmul_supports)
def matmul(n, a, b):
    if not _matmul_supports(n, (a, b)):
        return torch_nn.matmul(n, a, b)
    return _matmul(n, a, b)


@register(FC.FusedMatMul, backend="cuda", name="TritonFusedMatMul", tactics=_matmul_tactics,
          supports=_matmul_supports, makes_plan=_matmul_plan)
def fused_matmul(n, x, w, b=None, r=None):
    if not _matmul_supports(n, (x, w, b, r)):
        return torch_fused.fused_matmul(n, x, w, b, r)
    return _matmul(n, x, w, b, r, n.a.activation, n.a.alpha, n.a.beta)


def _gemm_operands(n, inputs):
    a, b = inputs[0], inputs[1]
    return (a.t() if n.a.transA else a), (b.t() if n.a.transB else b)


def _gemm_supports(n, inputs) -> bool:
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    r = inputs[3] if len(inputs) > 3 else None
    if not (_halves(a, b, c, r) and a.dim() == 2 and b.dim() == 2):
        return False
    a, b = _gemm_operands(n, inputs)
    m, nn = a.shape[0], b.shape[1]
    if a.shape[1] != b.shape[0] or a.numel() == 0 or nn == 0:
        return False
    # C: a bias row, or a full [M, N] addend (taken as the residual)
    c_ok = (c is None or (_bias_ok(c, nn) and c.dim() <= 2)
            or (tuple(c.shape) == (m, nn) and r is None))
    return c_ok and (r is None or tuple(r.shape) == (m, nn))


def _gemm_tactics(n, inputs) -> list[dict]:
    a, b = _gemm_operands(n, inputs)
    return gemm_tactics(a.shape[0], b.shape[1], a.shape[1])


def _gemm(n, a_in, b_in, c, r, activation="", alpha=1.0, beta=1.0, act_a=0.0, act_b=0.0):
    a, b = _gemm_operands(n, (a_in, b_in))
    nn = b.shape[1]
    if c is not None and beta != 1.0:
        c = c * beta
    if c is not None and c.numel() == nn:
        return gemm2d(n, a, b, c.reshape(-1), r, activation, alpha, act_a, act_b)
    return gemm2d(n, a, b, None, c if c is not None else r, activation, alpha, act_a, act_b)


@register(N.Gemm, backend="cuda", name="TritonGemm", tactics=_gemm_tactics,
          supports=_gemm_supports)
def gemm(n, a, b, c=None):
    if not _gemm_supports(n, (a, b, c)):
        return torch_nn.gemm(n, a, b, c)
    alpha = n.a.alpha if n.a.alpha is not None else 1.0
    beta = n.a.beta if n.a.beta is not None else 1.0
    return _gemm(n, a, b, c, None, alpha=alpha, beta=beta)


def _gemm_epilogue_inputs(n, inputs):
    """FusedGemm's (bias row, residual) in FusedMatMul's terms: C is the bias when it is a row
    of N values, else the [M, N] addend (the residual)."""
    c = inputs[2] if len(inputs) > 2 else None
    r = inputs[3] if len(inputs) > 3 else None
    nn = _gemm_operands(n, inputs)[1].shape[1]
    bias = c if c is not None and c.numel() == nn else None
    return bias, (r if r is not None else (c if c is not None and bias is None else None))


def _fused_gemm_tactics(n, inputs) -> list[dict]:
    """The Triton tiles, and (no transA) FusedMatMul's cuBLAS tactics: cuBLAS + the Triton
    epilogue pass, and cuBLASLt's own bias + ReLU / tanh-GELU epilogue (HF's Conv1D layers,
    GPT-2's MLP among them, export Gemm)."""
    tiles = _gemm_tactics(n, inputs)
    if n.a.transA:
        return tiles
    bias, res = _gemm_epilogue_inputs(n, inputs)
    act = n.a.activation
    out = tiles + ([dict(t) for t in CUBLAS_TACTICS] if act or res is not None else [])
    return out + ([dict(CUBLASLT_TACTIC)] if lt_fuses(act, bias, res) else [])


@register(FC.FusedGemm, backend="cuda", name="TritonFusedGemm", tactics=_fused_gemm_tactics,
          supports=_gemm_supports, makes_plan=_matmul_plan)
def fused_gemm(n, a, b, c=None, r=None):
    if not _gemm_supports(n, (a, b, c, r)):
        return torch_fused.fused_gemm(n, a, b, c, r)
    t = getattr(n, "tactic", None) or {}
    if t.get("impl") in ("cublas", "cublaslt") and not n.a.transA:
        x, w = _gemm_operands(n, (a, b))
        bias, res = _gemm_epilogue_inputs(n, (a, b, c, r))
        return _matmul(n, x, w, bias, res, n.a.activation, n.a.alpha, n.a.beta)
    return _gemm(n, a, b, c, r, n.a.activation, act_a=n.a.alpha, act_b=n.a.beta)


# ---------------------------------------------------------------- product + LayerNorm

# LayerNorm warps per row (BERT's 768-wide rows: one warp per row was the tuner's pick)
LN_WARPS = (1, 4)


def _mm_ln_supports(n, inputs) -> bool:
    x, w = inputs[0], inputs[1]
    b, r = (inputs[2] if len(inputs) > 2 else None), (inputs[3] if len(inputs) > 3 else None)
    scale = inputs[4] if len(inputs) > 4 else None
    ln_bias = inputs[5] if len(inputs) > 5 else None
    nn = w.shape[-1] if isinstance(w, torch.Tensor) and w.dim() == 2 else 0
    return (scale is not None and _matmul_supports(n, (x, w, b, r)) and on_device(scale, ln_bias)
            and scale.dtype in FLOATS and (ln_bias is None or ln_bias.dtype == scale.dtype)
            and scale.numel() == nn and (ln_bias is None or ln_bias.numel() == nn)
            and next_pow2(nn) <= 8192)


def _mm_ln_tactics(n, inputs) -> list[dict]:
    m, nn, k = _mm_shapes(n, inputs)
    tiles = [dict(t, LN_WARPS=1) for t in gemm_tactics(m, nn, k)]
    if n.a.activation:  # cuBLAS + LN(y + r) only where no activation sits between them
        return tiles
    rows = [{"impl": "cublas", "LN_WARPS": t["num_warps"], "LN_ROWS": t["ROWS"]}
            for t in row_tiles(next_pow2(nn), m)]  # the norm over several rows a program
    return tiles + [{"impl": "cublas", "LN_WARPS": w} for w in LN_WARPS] + rows


@register(FC.FusedMatMulLayerNorm, backend="cuda", name="TritonFusedMatMulLayerNorm",
          tactics=_mm_ln_tactics, supports=_mm_ln_supports, makes_plan=_matmul_plan)
def fused_matmul_layernorm(n, x, w, b=None, r=None, scale=None, ln_bias=None):
    """LayerNorm(act(x @ w + b + r)): the Triton tile or cuBLAS(Lt) for ``x @ w + b``, then
    the norm in place on its fresh output, adding the residual as it reads the row (BERT's
    post-norm blocks: no separate residual pass). With an activation the residual comes
    before it, in the Triton tile's epilogue. (The tile took the residual in its epilogue in
    every case until its GPU test of 2026-12-04 stopped answering in the case of a 16x16 tile
    with a residual and no activation; the norm adds it there now, in the same traffic.)"""
    if not _mm_ln_supports(n, (x, w, b, r, scale, ln_bias)):
        return torch_fused.fused_matmul_layernorm(n, x, w, b, r, scale, ln_bias)
    t = getattr(n, "tactic", None) or {}
    nn = w.shape[1]
    eps = float(n.a.epsilon if n.a.epsilon is not None else 1e-5)
    block, warps, rows = next_pow2(nn), t.get("LN_WARPS", 1), t.get("LN_ROWS", 1)
    x2 = x.reshape(-1, x.shape[-1])
    r2 = None if r is None else r.reshape(-1, nn)
    b1 = None if b is None else b.reshape(-1)
    if t.get("impl") == "cublas" and not n.a.activation and (r2 is None or r2.is_contiguous()):
        y = F.linear(x2, w.t(), b1)
        norm_rows(y, scale, ln_bias, nn, eps, False, block, warps, res=r2, out=y, rows=rows)
    elif not n.a.activation:
        y = gemm2d(n, x2, w, b1)
        norm_rows(y, scale, ln_bias, nn, eps, False, block, warps, res=r2, out=y)
    else:
        y = gemm2d(n, x2, w, b1, r2, n.a.activation, 1.0, n.a.alpha, n.a.beta)
        norm_rows(y, scale, ln_bias, nn, eps, False, block, warps, out=y)
    return y.reshape(*x.shape[:-1], nn)
