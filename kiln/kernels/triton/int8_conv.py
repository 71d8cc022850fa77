"""Int8Conv on CUDA: an implicit-GEMM INT8 convolution over channels-last activations.

The structure of :mod:`kiln.kernels.triton.implicit_gemm` (an [N*OH*OW, KH*KW*C] patch matrix
never written, walked per (window tap, channel block), or flat for a few input channels) with
8-bit operands: the activation is float, quantized in registers (``floor(x / x_scale + 0.5) +
x_zero - 128``), or already int8 codes (a quantized hand-off), where padding reads the code of
0.0; the weight is int8, K-major per output channel; products accumulate in int32 on the tensor
cores; the epilogue dequantizes (``* x_scale * w_scale[o]``, less ``(x_zero - 128) *
colsum(W)[o]``), adds bias and residual, applies the activation and stores the float output or
its reader's codes. One group, symmetric pads. Beside it the autotuner times the FP16 tactic
(``Fp16Int8Conv``): the input through the same quantizer in one pass, then the FP16 FusedConv
kernel (cuDNN or kiln's tiles) on the weight dequantized once.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import int8 as torch_int8
from kiln.kernels.torch.fused_conv import symmetric_geometry
from kiln.kernels.torch.int8 import _cached, float_dtype
from kiln.kernels.triton.common import (
    ACT_CODE,
    FLOATS,
    HALF,
    INTERPRET,
    epilogue,
    grouped_tile,
    launch,
    on_device,
    quantize8,
    tactic_of,
)
from kiln.kernels.triton.gemm import best_tiles, fitting_tiles
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import int8 as I8

CL = torch.channels_last
FLAT_BELOW = 16  # input channels below which K is walked flat (the stem's 3)


@jit(do_not_specialize=["H", "W", "OH", "OW", "M", "zint"])  # zint: .to() below
def _q8_conv_kernel(X, Wt, Y, WS, CS, Bias, R, H, W, C, OH, OW, CO, M,
                    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, act_a, act_b,
                    x_scale, zshift, zint, out_scale, out_shift,
                    KH: tl.constexpr, KW: tl.constexpr, FLAT: tl.constexpr,
                    X_CODES: tl.constexpr, OUT_CODES: tl.constexpr, EXACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, CO, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    ow = rm % OW
    oh = (rm // OW) % OH
    nb = rm // (OW * OH)
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    k_total = KH * KW * C
    w_rows = Wt + (rn % CO)[None, :].to(tl.int64) * k_total
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if FLAT:
        for k0 in range(0, k_total, BLOCK_K):
            kk = k0 + rk
            c = kk % C
            kw = (kk // C) % KW
            kh = kk // (C * KW)
            ih = ih0[:, None] + kh[None, :] * dil_h
            iw = iw0[:, None] + kw[None, :] * dil_w
            ok = (m_ok[:, None] & (kk[None, :] < k_total) & (ih >= 0) & (ih < H)
                  & (iw >= 0) & (iw < W))
            ptrs = X + ((nb[:, None] * H + ih) * W + iw).to(tl.int64) * C + c[None, :]
            if X_CODES:  # padding: the code of 0.0
                a = tl.load(ptrs, mask=ok, other=0)
                a = tl.where(ok, a, zint.to(tl.int8))
            else:
                a = quantize8(tl.load(ptrs, mask=ok, other=0.0).to(tl.float32), x_scale,
                              zshift, False, EXACT)
            b = tl.load(w_rows + kk[:, None], mask=kk[:, None] < k_total, other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
    else:
        c_steps = tl.cdiv(C, BLOCK_K)
        for step in range(0, KH * KW * c_steps):
            tap = step // c_steps
            cc = (step - tap * c_steps) * BLOCK_K + rk
            kh = tap // KW
            ih = ih0 + kh * dil_h
            iw = iw0 + (tap - kh * KW) * dil_w
            ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            pix = ((nb * H + ih) * W + iw).to(tl.int64)
            ptrs = X + pix[:, None] * C + cc[None, :]
            mask = ok[:, None] & (cc[None, :] < C)
            if X_CODES:
                a = tl.load(ptrs, mask=mask, other=0)
                a = tl.where(ok[:, None], a, zint.to(tl.int8))
            else:
                a = quantize8(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), x_scale,
                              zshift, False, EXACT)
            b = tl.load(w_rows + (tap * C + cc)[:, None], mask=cc[:, None] < C, other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
    cols = rn < CO
    corr = tl.load(CS + rn, mask=cols, other=0) * zint
    ws = tl.load(WS + rn, mask=cols, other=0.0)
    y = (acc - corr[None, :]).to(tl.float32) * (ws * x_scale)[None, :]
    mask = m_ok[:, None] & cols[None, :]
    offs = rm[:, None].to(tl.int64) * CO + rn[None, :]
    y = epilogue(y, Bias, rn, CO, R + offs, mask, act_a, act_b, HAS_BIAS, HAS_RES, ACT)
    if OUT_CODES:
        tl.store(Y + offs, quantize8(y, out_scale, out_shift, False, EXACT), mask=mask)
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages); int8 steps of K >= 32
_CONFIGS = (
    (128, 128, 64, 8, 1, 8, 3), (128, 128, 128, 8, 1, 8, 3), (128, 64, 64, 8, 1, 4, 4),
    (64, 128, 64, 8, 1, 4, 4), (128, 256, 64, 8, 1, 8, 3), (64, 64, 64, 8, 1, 4, 4),
    (64, 64, 32, 8, 1, 4, 4), (32, 64, 64, 8, 1, 4, 4), (16, 64, 64, 8, 1, 2, 4),
)
DEFAULT = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, SPLIT_K=1, num_warps=4,
               num_stages=3)


def _geometry(n, x, wq):
    return symmetric_geometry(n, x, wq) if x.dim() == 4 and wq.dim() == 4 else None


def supports(n, inputs) -> bool:
    x, wq = inputs[0], inputs[1]
    b = inputs[3] if len(inputs) > 3 else None
    r = inputs[4] if len(inputs) > 4 else None
    if not (on_device(*[t for t in inputs if t is not None]) and x.dim() == 4
            and wq.dim() == 4 and x.numel() > 0 and (n.a.group or 1) == 1
            and x.shape[1] == wq.shape[1] and n.a.x_scale > 0
            and (x.dtype in FLOATS or x.dtype == torch.int8)):
        return False
    geo = _geometry(n, x, wq)
    if geo is None:
        return False
    out = (x.shape[0], wq.shape[0], *geo[3])
    return (b is None or b.numel() == wq.shape[0]) and (r is None or tuple(r.shape) == out)


def tactics(n, inputs) -> list[dict]:
    x, wq = inputs[0], inputs[1]
    geo = _geometry(n, x, wq)
    if geo is None:
        return [dict(DEFAULT)]
    m = x.shape[0] * geo[3][0] * geo[3][1]
    return best_tiles(fitting_tiles(_CONFIGS, m, wq.shape[0]), m, wq.shape[0]) or [
        dict(DEFAULT)]


def _out(x, dtype, co: int, oh: int, ow: int):
    return torch.empty((x.shape[0], co, oh, ow), dtype=dtype, device=x.device,
                       memory_format=CL)


@register(I8.Int8Conv, backend="cuda", name="TritonInt8Conv", tactics=tactics,
          supports=supports)
def triton_int8_conv(n, x, wq, w_scale, b=None, r=None):
    if not supports(n, (x, wq, w_scale, b, r)):
        return torch_int8.int8_conv(n, x, wq, w_scale, b, r)
    a, t = n.a, tactic_of(n, DEFAULT)
    (pad_h, pad_w), (sh, sw), (dh, dw), (oh, ow) = _geometry(n, x, wq)
    nb, c, h, wd = x.shape
    co, _, kh, kw = wq.shape
    m = nb * oh * ow
    if not x.is_contiguous(memory_format=CL):
        x = x.contiguous(memory_format=CL)
    if r is not None and not r.is_contiguous(memory_format=CL):
        r = r.contiguous(memory_format=CL)
    wk = _cached(n, "w_taps", lambda: wq.permute(0, 2, 3, 1).contiguous())  # [CO, KH, KW, C]
    colsum = _cached(n, "colsum", lambda: wq.sum((1, 2, 3), dtype=torch.int32))
    codes_out = a.out_scale > 0
    y = _out(x, torch.int8 if codes_out else float_dtype(a, x), co, oh, ow)
    zero = a.x_zero - 128
    grid = (cdiv(m, t["BLOCK_M"]) * cdiv(co, t["BLOCK_N"]),)
    launch(_q8_conv_kernel, grid, x, wk, y, w_scale, colsum, y if b is None else b,
           y if r is None else r, h, wd, c, oh, ow, co, m, sh, sw, pad_h, pad_w, dh, dw,
           float(a.alpha or 0.0), float(a.beta or 0.0), float(a.x_scale), float(zero),
           int(zero), float(a.out_scale) if codes_out else 1.0, float(a.out_zero - 128),
           KH=kh, KW=kw, FLAT=c < FLAT_BELOW, X_CODES=x.dtype == torch.int8,
           OUT_CODES=codes_out, EXACT=INTERPRET, HAS_BIAS=b is not None,
           HAS_RES=r is not None, ACT=ACT_CODE[a.activation], BLOCK_M=t["BLOCK_M"],
           BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], GROUP_M=t["GROUP_M"],
           num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y


# ---------------------------------------------------------------- the FP16 tactic

def _float_like(n, x):
    """A stand-in of the float input the FP16 tactic convolves (for its tactic space)."""
    if x.dtype != torch.int8:
        return x
    return torch.empty(x.shape, dtype=float_dtype(n.a, x), device=x.device, memory_format=CL)


def _fp16_supports(n, inputs) -> bool:
    from kiln.kernels.triton import conv

    x, wq = inputs[0], inputs[1]
    b = inputs[3] if len(inputs) > 3 else None
    r = inputs[4] if len(inputs) > 4 else None
    ft = float_dtype(n.a, x)
    if not supports(n, inputs) or ft not in HALF or (r is not None and r.dtype != ft):
        return False
    xf = _float_like(n, x)
    wf = torch.empty(wq.shape, dtype=ft, device=x.device)
    return conv.supports(n, (xf, wf, b, r))


def _fp16_tactics(n, inputs) -> list[dict]:
    from kiln.kernels.triton import conv

    x, wq = inputs[0], inputs[1]
    xf = _float_like(n, x)
    wf = torch.empty(wq.shape, dtype=xf.dtype, device=x.device)
    rest = list(inputs[3:5]) + [None] * 2
    return conv.tactics(n, (xf, wf, rest[0], rest[1]))


def _fp16_plan(t):
    from kiln.kernels.triton import conv

    return conv.makes_plan(t)


def fp16_int8_conv(n, x, wq, w_scale, b=None, r=None):
    """The FP16 tactic: the same layer through FP16 FusedConv (see the module docstring)."""
    from kiln.kernels.triton import conv
    from kiln.kernels.triton.int8_gemm import _codes_pass

    a = n.a
    ft = float_dtype(a, x)
    if not x.is_contiguous(memory_format=CL):
        x = x.contiguous(memory_format=CL)
    xf = _codes_pass(x, ft, a.x_scale, a.x_zero - 128, False, encode=False)
    w = _cached(n, ("w_dequantized", ft), lambda: (
        wq.float() * w_scale.reshape(-1, 1, 1, 1)).to(ft).contiguous(memory_format=CL))
    y = conv.fused_conv(n, xf, w, None if b is None else b.to(ft), r)
    if a.out_scale > 0:
        y = _codes_pass(y.contiguous(memory_format=CL), torch.int8, a.out_scale,
                        a.out_zero - 128, False, encode=True)
    return y


register(I8.Int8Conv, backend="cuda", name="Fp16Int8Conv", tactics=_fp16_tactics,
         supports=_fp16_supports, makes_plan=_fp16_plan)(fp16_int8_conv)
