"""Depthwise convolution on channels-last activations, epilogue fused.

A depthwise conv (one group per input channel: MobileNet's and EfficientNet's 3x3 and 5x5,
ConvNeXt's 7x7) does KH*KW multiply-adds per output element: it is bound by memory, not math,
so it is no GEMM. Each program takes a [BLOCK_P output pixels, BLOCK_C channels] tile of the
NHWC output and walks the window's taps; a tap's load is BLOCK_P runs of BLOCK_C contiguous
channels, and padding is a mask on the pixel::

    y[p, o] = act(sum_{kh, kw} x[pixel(p, kh, kw), o // MULT] * w[o, kh, kw] + bias[o] + res[p, o])

``MULT`` is the channel multiplier (output channels per input channel). Accumulation is fp32.
Like the implicit GEMM, its compiled kernels travel in the engine file: no cuDNN plan to make
at the first run.
"""

from __future__ import annotations

from kiln.kernels.triton.common import (
    ACT_CODE,
    PIXEL_TILE_KEYS,
    channels_last_out,
    epilogue,
    launch,
    nhwc_pixels,
    pixel_channel_tiles,
    window_tap,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl

# (pixels, channels, warps): wide channel tiles for coalesced loads, taller ones for few channels
_CONFIGS = ((32, 64, 4), (64, 32, 4), (16, 128, 4), (64, 64, 4), (128, 32, 4), (32, 128, 8),
            (128, 16, 4))
DEFAULT = dict(zip(PIXEL_TILE_KEYS, (32, 64, 4)), impl="depthwise")


# the spatial extents vary per layer; specializing on them (== 1, % 16) compiled a kernel per
# layer shape and tactic at build. Channels (the contiguous dim) stay specialized.
@jit(do_not_specialize=["P", "H", "W", "OH", "OW"])
def _dw_kernel(X, Wt, Y, Bias, R, P, H, W, C, OH, OW, CO, MULT,
               stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, act_a, act_b,
               KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_RES: tl.constexpr, ACT: tl.constexpr,
               BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    rp, p_ok, nb, oh, ow = nhwc_pixels(P, OH, OW, BLOCK_P)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = rc < CO
    ic = rc // MULT
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            pix, ok = window_tap(nb, oh, ow, p_ok, kh, kw, H, W, stride_h, stride_w, pad_h,
                                 pad_w, dil_h, dil_w)
            x = tl.load(X + pix[:, None] * C + ic[None, :], mask=ok[:, None] & c_ok[None, :],
                        other=0.0)
            wv = tl.load(Wt + rc * (KH * KW) + (kh * KW + kw), mask=c_ok, other=0.0)
            acc += x.to(tl.float32) * wv.to(tl.float32)[None, :]
    offs = rp[:, None].to(tl.int64) * CO + rc[None, :]
    mask = p_ok[:, None] & c_ok[None, :]
    y = epilogue(acc, Bias, rc, CO, R + offs, mask, act_a, act_b, HAS_BIAS, HAS_RES, ACT)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def is_depthwise(groups: int, x, w) -> bool:
    """One group per input channel, each with its own filters (w: [C * mult, 1, KH, KW])."""
    return groups > 1 and groups == x.shape[1] and w.shape[1] == 1 and w.shape[0] % groups == 0


def tactics(co: int, p: int) -> list[dict]:
    """The tiles worth timing: none wider than twice the channels or taller than twice the
    output pixels."""
    return pixel_channel_tiles(_CONFIGS, co, p, DEFAULT, impl="depthwise")


def conv2d(t: dict, x, w, bias, res, geometry, activation: str = "", act_a: float = 0.0,
           act_b: float = 0.0):
    """``act(depthwise_conv(x, w) + bias + res)``; ``x``, ``res`` channels-last 4-D, ``w``
    [C * mult, 1, KH, KW] (any layout: read as KH*KW values per output channel);
    ``geometry`` as in :func:`kiln.kernels.triton.implicit_gemm.conv2d`. Returns the
    channels-last output."""
    (pad_h, pad_w), (sh, sw), (dh, dw), (oh, ow) = geometry
    nb, c, h, wd = x.shape
    co, _, kh, kw = w.shape
    p = nb * oh * ow
    y = channels_last_out(x, co, oh, ow)
    w = w.reshape(co, kh * kw)  # [co, 1, kh, kw] in either layout holds kh*kw values per o
    grid = (cdiv(p, t["BLOCK_P"]), cdiv(co, t["BLOCK_C"]))
    launch(_dw_kernel, grid, x, w, y, y if bias is None else bias, y if res is None else res,
           p, h, wd, c, oh, ow, co, co // c, sh, sw, pad_h, pad_w, dh, dw, float(act_a),
           float(act_b), KH=kh, KW=kw, HAS_BIAS=bias is not None, HAS_RES=res is not None,
           ACT=ACT_CODE[activation], BLOCK_P=t["BLOCK_P"], BLOCK_C=t["BLOCK_C"],
           num_warps=t["num_warps"])
    return y
