"""Convolution as an implicit GEMM over channels-last activations, epilogue fused.

The conv is the product of an [M, K] matrix of input patches (M = N*OH*OW output pixels,
K = KH*KW*C) and the weight seen as [K, CO]; neither the patch matrix nor the output in another
layout is ever written. Each program computes a [BLOCK_M, BLOCK_N] tile of the NHWC output::

    y[p, o] = act(sum_k patch[p, k] * w[o, k] + bias[o] + residual[p, o])

walking K in steps of (window tap, block of BLOCK_K input channels): one tap's rows are NHWC
pixels, so a [BLOCK_M, BLOCK_K] load is BLOCK_M runs of contiguous channels, and padding is a
mask on the pixel. Layers with few input channels (a 3-channel stem) would waste most of each
step that way, so there (``FLAT``) K is walked as one flat index, decoded into (kh, kw, c) per
element. ``SPLIT_K`` > 1 gives each of that many programs every SPLIT_K-th step and sums their
fp32 partials in a second pass that also applies the epilogue: small outputs (batch 1, 7x7
feature maps) have too few tiles to fill the GPU otherwise.

Why it exists: its compiled kernels travel in the engine file, where cuDNN's per-layer-shape
plans are made at an engine's first run (tens of ms per shape), so an engine whose convs all
run here loads and runs its first inference without any of that.
"""

from __future__ import annotations

import torch

from kiln.kernels.triton.common import (
    ACT_CODE,
    channels_last_out,
    epilogue,
    grouped_tile,
    launch,
)
from kiln.kernels.triton.gemm import (
    KEYS,
    SMS,
    best_tiles,
    fitting_tiles,
    splitk_epilogue,
    tile_count,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl

# input channels below which K is walked flat (a BLOCK_K step of one tap would be mostly mask)
FLAT_BELOW = 16
# the GEMM template's usual tiles, smaller ones for batch-1 feature maps, and split-K ones for
# outputs of a few tiles (ResNet-50's 7x7 and 14x14 stages at small batch)
_CONFIGS = (
    (128, 128, 64, 8, 1, 8, 3), (128, 64, 64, 8, 1, 4, 3), (64, 128, 64, 8, 1, 4, 3),
    (64, 64, 64, 8, 1, 4, 3), (64, 64, 32, 8, 1, 4, 4), (32, 64, 64, 8, 1, 4, 4),
    (64, 32, 64, 8, 1, 4, 4), (32, 32, 64, 8, 1, 2, 4), (64, 64, 64, 8, 2, 4, 3),
    (32, 64, 64, 8, 2, 4, 4), (64, 64, 64, 8, 4, 4, 3), (32, 64, 64, 8, 4, 4, 3),
    (32, 64, 64, 8, 8, 4, 3), (16, 64, 128, 8, 8, 4, 3),
)
DEFAULT = dict(zip(KEYS, (64, 64, 32, 8, 1, 4, 3)), impl="igemm")


# the spatial extents and rows vary per layer; specializing on them (== 1, % 16) compiled a
# kernel per layer shape and tactic at build. Channels (the contiguous dim) stay specialized.
@jit(do_not_specialize=["P", "H", "W", "OH", "OW", "M"])
def _conv_kernel(X, Wt, Y, Bias, R, P, H, W, C, OH, OW, CO, M,
                 stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, act_a, act_b,
                 KH: tl.constexpr, KW: tl.constexpr, FLAT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, CO, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
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
    # out-of-range output channels read channel 0's weights (masked on store)
    w_rows = Wt + (rn % CO)[None, :].to(tl.int64) * k_total
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT:
        for k0 in range(pid_k * BLOCK_K, k_total, BLOCK_K * SPLIT_K):
            kk = k0 + rk
            c = kk % C
            kw = (kk // C) % KW
            kh = kk // (C * KW)
            ih = ih0[:, None] + kh[None, :] * dil_h
            iw = iw0[:, None] + kw[None, :] * dil_w
            ok = (m_ok[:, None] & (kk[None, :] < k_total) & (ih >= 0) & (ih < H)
                  & (iw >= 0) & (iw < W))
            pix = (nb[:, None] * H + ih) * W + iw
            a = tl.load(X + pix.to(tl.int64) * C + c[None, :], mask=ok, other=0.0)
            b = tl.load(w_rows + kk[:, None], mask=kk[:, None] < k_total, other=0.0)
            acc = tl.dot(a, b, acc)
    else:
        # one loop over (tap, channel block) steps, not a loop per tap: Triton pipelines the
        # loads of the innermost loop only, and a tap has one or two channel blocks
        c_steps = tl.cdiv(C, BLOCK_K)
        for step in range(pid_k, KH * KW * c_steps, SPLIT_K):
            tap = step // c_steps
            cc = (step - tap * c_steps) * BLOCK_K + rk
            kh = tap // KW
            ih = ih0 + kh * dil_h
            iw = iw0 + (tap - kh * KW) * dil_w
            ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            pix = ((nb * H + ih) * W + iw).to(tl.int64)
            a = tl.load(X + pix[:, None] * C + cc[None, :],
                        mask=ok[:, None] & (cc[None, :] < C), other=0.0)
            b = tl.load(w_rows + (tap * C + cc)[:, None], mask=cc[:, None] < C, other=0.0)
            acc = tl.dot(a, b, acc)
    mask = m_ok[:, None] & (rn[None, :] < CO)
    offs = rm[:, None].to(tl.int64) * CO + rn[None, :]
    if SPLIT_K == 1:
        y = epilogue(acc, Bias, rn, CO, R + offs, mask, act_a, act_b, HAS_BIAS, HAS_RES, ACT)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(P + pid_k * M * CO + offs, acc, mask=mask)


def tactics(nb: int, c: int, co: int, kh: int, kw: int, oh: int, ow: int) -> list[dict]:
    """The tiles worth timing for this conv: none more than twice the output's extent, split-K
    only where the plain tiles are too few to fill the GPU and every split has two K steps."""
    m = nb * oh * ow
    out = []
    for t in fitting_tiles(_CONFIGS, m, co):
        bk = t["BLOCK_K"]
        steps = -(-kh * kw * c // bk) if c < FLAT_BELOW else kh * kw * -(-c // bk)
        if t["SPLIT_K"] > 1 and (tile_count(t, m, co) * 2 > SMS or steps < 2 * t["SPLIT_K"]):
            continue
        out.append(dict(t, impl="igemm"))
    return best_tiles(out, m, co) or [dict(DEFAULT)]


def conv2d(t: dict, x, w, bias, res, geometry, activation: str = "", act_a: float = 0.0,
           act_b: float = 0.0):
    """``act(conv(x, w) + bias + res)``, one group. ``x``, ``w``, ``res``: channels-last 4-D
    (w: [CO, C, KH, KW] with KH*KW*C contiguous per output channel); ``geometry``: the
    (pads, strides, dilations, (OH, OW)) of ``kiln.kernels.torch.fused_conv.symmetric_geometry``.
    Returns the channels-last output."""
    (pad_h, pad_w), (sh, sw), (dh, dw), (oh, ow) = geometry
    nb, c, h, wd = x.shape
    co, _, kh, kw = w.shape
    m = nb * oh * ow
    y = channels_last_out(x, co, oh, ow)
    split = t["SPLIT_K"]
    p = torch.empty((split, m, co), dtype=torch.float32, device=x.device) if split > 1 else y
    codes = dict(HAS_BIAS=bias is not None, HAS_RES=res is not None, ACT=ACT_CODE[activation])
    grid = (cdiv(m, t["BLOCK_M"]) * cdiv(co, t["BLOCK_N"]), split)
    launch(_conv_kernel, grid, x, w, y, y if bias is None else bias, y if res is None else res,
           p, h, wd, c, oh, ow, co, m, sh, sw, pad_h, pad_w, dh, dw, float(act_a),
           float(act_b), KH=kh, KW=kw, FLAT=c < FLAT_BELOW, **codes,
           BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
           GROUP_M=t["GROUP_M"], SPLIT_K=split, num_warps=t["num_warps"],
           num_stages=t["num_stages"])
    if split > 1:
        block = 1024
        launch(splitk_epilogue, (cdiv(m * co, block),), p, y,
               y if bias is None else bias, y if res is None else res, m, co, co, 1, co, 1,
               1.0, float(act_a), float(act_b), **codes, SPLIT_K=split, BLOCK=block,
               num_warps=4)
    return y
