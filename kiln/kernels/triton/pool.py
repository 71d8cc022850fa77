"""2-D max pooling on channels-last activations.

A CNN's stem pool (ResNet's 3x3 stride-2 MaxPool on a [N, 64, 112, 112] map) reads the largest
activation of the network: on the H200 at batch 256 PyTorch's channels-last kernel took 0.83 ms
of a 7.2 ms ResNet-50 pass (11%), about 0.6 TB/s (``python -m bench.cuda_profile``). Here each
program takes a [BLOCK_P output pixels, BLOCK_C channels] tile and walks the window's taps; a
tap's load is BLOCK_P runs of BLOCK_C contiguous channels, and padding (begin pads; the end
pads and ``ceil_mode`` only set the output size) is a mask::

    y[n, oh, ow, c] = max_{kh, kw} x[n, oh * sh - ph + kh * dh, ow * sw - pw + kw * dw, c]

One output (no indices), float inputs, 2 spatial dims; anything else runs the PyTorch kernel.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import nn as torch_nn
from kiln.kernels.triton.common import (
    PIXEL_TILE_KEYS,
    channels_last_out,
    launch,
    nhwc_pixels,
    on_device,
    pixel_channel_tiles,
    tactic_of,
    window_tap,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import nn as N

_CONFIGS = ((32, 64, 4), (64, 64, 4), (16, 128, 4), (128, 32, 4), (64, 128, 8), (128, 16, 4))
DEFAULT = dict(zip(PIXEL_TILE_KEYS, (32, 64, 4)))


@jit(do_not_specialize=["P", "H", "W", "OH", "OW"])
def _maxpool_kernel(X, Y, P, H, W, C, OH, OW, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                    KH: tl.constexpr, KW: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    rp, p_ok, nb, oh, ow = nhwc_pixels(P, OH, OW, BLOCK_P)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = rc < C
    acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), dtype=tl.float32)
    for kh in tl.static_range(KH):
        for kw in tl.static_range(KW):
            pix, ok = window_tap(nb, oh, ow, p_ok, kh, kw, H, W, stride_h, stride_w, pad_h,
                                 pad_w, dil_h, dil_w)
            x = tl.load(X + pix[:, None] * C + rc[None, :], mask=ok[:, None] & c_ok[None, :],
                        other=float("-inf"))
            acc = tl.maximum(acc, x.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
    offs = rp[:, None].to(tl.int64) * C + rc[None, :]
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


def _geometry(n, x):
    k, s, d, out, pb, _ = torch_nn._pool_setup(n, x)
    return k, s, d, out, pb


def supports(n, inputs) -> bool:
    x = inputs[0]
    return (n.n_out == 1 and on_device(x) and isinstance(x, torch.Tensor) and x.dim() == 4
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel() > 0
            and x.is_contiguous(memory_format=torch.channels_last))


def _tactics(n, inputs) -> list[dict]:
    x = inputs[0]
    _, _, _, (oh, ow), _ = _geometry(n, x)
    p, c = x.shape[0] * oh * ow, x.shape[1]
    return pixel_channel_tiles(_CONFIGS, c, p, DEFAULT)


@register(N.MaxPool, backend="cuda", name="TritonMaxPool", tactics=_tactics, supports=supports)
def max_pool(n, x):
    if not supports(n, (x,)):
        return torch_nn.max_pool(n, x)
    t = tactic_of(n, DEFAULT)
    (kh, kw), (sh, sw), (dh, dw), (oh, ow), (ph, pw) = _geometry(n, x)
    nb, c, h, w = x.shape
    y = channels_last_out(x, c, oh, ow)
    p = nb * oh * ow
    if p == 0:
        return y
    grid = (cdiv(p, t["BLOCK_P"]), cdiv(c, t["BLOCK_C"]))
    launch(_maxpool_kernel, grid, x, y, p, h, w, c, oh, ow, sh, sw, ph, pw, dh, dw,
           KH=kh, KW=kw, BLOCK_P=t["BLOCK_P"], BLOCK_C=t["BLOCK_C"], num_warps=t["num_warps"])
    return y
