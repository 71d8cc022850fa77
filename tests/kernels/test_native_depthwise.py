"""kiln.native's depthwise convolution (``kiln_depthwise`` in kiln/native/depthwise.c) against
torch's conv2d in float64 — pads per side, strides 1 and 2, dilation, odd sizes, channel counts
that are not multiples of 8, bias, residual, activations — and FusedConv's depthwise tactic
(timed against oneDNN; the only one for asymmetric pads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops import fused_conv as FC

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
CL = torch.channels_last
RTOL = 1e-5  # of max |reference|: a depthwise tap sum is at most 49 products in float32
ACTS = {"": lambda y: y, "Relu": F.relu, "Clip": lambda y: y.clamp(-0.5, 0.5),
        "HardSwish": F.hardswish, "Silu": F.silu, "Sigmoid": torch.sigmoid,
        "LeakyRelu": lambda y: F.leaky_relu(y, 0.1)}


def _reference(x, w, b, r, pads, stride, dil, act):
    """pads = (top, left, bottom, right)."""
    t, left, bot, right = pads
    xp = F.pad(x.double(), (left, right, t, bot))
    y = F.conv2d(xp, w.double(), None if b is None else b.double(), stride=stride,
                 dilation=dil, groups=x.shape[1])
    if r is not None:
        y = y + r.double()
    return ACTS[act](y)


def _close(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = float((got.double() - want).abs().max()), float(want.abs().max())
    assert err <= RTOL * scale, f"max error {err:.3g} > {RTOL} * {scale:.3g}"


CASES = [  # N, C, H, W, k, pads (t, l, b, r), stride, dilation, bias, residual, act
    (1, 16, 8, 8, 3, (1, 1, 1, 1), 1, 1, True, False, "Relu"),
    (2, 24, 9, 7, 3, (0, 0, 1, 1), 2, 1, True, False, "HardSwish"),  # TF "same", stride 2
    (1, 13, 11, 10, 5, (2, 2, 2, 2), 1, 1, False, False, "Clip"),   # 13 channels: a tail
    (1, 40, 10, 12, 5, (1, 2, 2, 1), 2, 1, True, True, "Silu"),     # asymmetric, residual
    (1, 8, 9, 9, 3, (2, 2, 2, 2), 1, 2, True, False, "LeakyRelu"),  # dilation 2
    (1, 5, 4, 3, 7, (3, 3, 3, 3), 1, 1, True, False, "Sigmoid"),    # kernel wider than input
    (3, 32, 6, 6, 3, (0, 0, 0, 0), 1, 1, True, False, ""),          # no padding
    # wide rows: the interior in blocks of 8 and 4 pixels and single ones, beside the borders
    (1, 16, 3, 31, 5, (2, 2, 2, 2), 1, 1, True, True, "HardSwish"),
    (1, 13, 4, 29, 3, (1, 1, 1, 1), 1, 1, True, True, "Relu"),      # tail channels, blocked
    (2, 24, 5, 40, 3, (0, 1, 1, 0), 2, 1, False, False, "Clip"),   # stride 2, "same"
    (1, 8, 4, 30, 3, (1, 2, 1, 2), 1, 2, True, False, ""),         # dilation 2, blocked
    # AVX-512's 16-channel blocks and 16/8/4/2/1-pixel runs of shared input loads (3x3, 5x5,
    # strides 1 and 2), channel tails of 16-wide blocks, other windows in dw_block16
    (1, 40, 3, 47, 3, (1, 1, 1, 1), 1, 1, True, True, "Silu"),      # 47 = 1 + 16 + 16 + ... + 1
    (1, 58, 4, 63, 3, (1, 1, 1, 1), 2, 1, True, False, "Relu"),     # shufflenet's 58, stride 2
    (2, 33, 5, 38, 5, (2, 2, 2, 2), 1, 1, False, True, "HardSwish"),  # 5x5, tail of 1
    (1, 48, 6, 45, 5, (1, 2, 2, 1), 2, 1, True, False, "Clip"),     # 5x5 s2, asymmetric
    (1, 16, 3, 37, 7, (3, 3, 3, 3), 1, 1, True, False, "Sigmoid"),  # 7x7: dw_block16
    (1, 20, 4, 35, 3, (2, 2, 2, 2), 1, 2, True, True, "LeakyRelu"),  # dilation 2, 16 + 4
    # AVX-512's zero-padded short rows under wide windows (5x5 and 7x7 on small maps)
    (1, 20, 7, 7, 5, (2, 2, 2, 2), 1, 1, True, True, "Silu"),       # 4 of 7 pixels at borders
    (2, 37, 14, 14, 5, (2, 2, 2, 2), 1, 1, True, False, "HardSwish"),
    (1, 17, 9, 9, 7, (3, 2, 3, 4), 1, 1, False, True, "Clip"),      # asymmetric, 7x7
    (1, 24, 14, 14, 5, (1, 2, 2, 1), 2, 1, True, False, "Relu"),    # stride 2, "same"
    # AVX-512's dilation-2 shared-load runs (3x3 and 5x5 at stride 1): LR-ASPP's 5x5 on 20 x
    # 20 (padded rows), wide rows in runs beside the borders, a 3x3 one with a channel tail
    (1, 40, 20, 20, 5, (4, 4, 4, 4), 1, 2, True, False, "HardSwish"),
    (1, 35, 6, 45, 5, (4, 4, 4, 4), 1, 2, True, True, "Relu"),
    (1, 24, 5, 41, 3, (2, 2, 2, 2), 1, 2, False, False, "Silu"),
    (1, 16, 3, 30, 3, (2, 2, 2, 2), 2, 2, True, False, ""),         # stride 2: dw_block16
]


def _data(n, c, h, w, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, h, w, generator=g), torch.randn(c, 1, k, k, generator=g) / k,
            torch.randn(c, generator=g), g)


@needs_native
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_depthwise_matches_torch(conv_isa, case):
    n, c, h, w, k, pads, s, d, has_b, has_r, act = case
    x, wt, b, g = _data(n, c, h, w, k)
    b = b if has_b else None
    ho = (h + pads[0] + pads[2] - d * (k - 1) - 1) // s + 1
    wo = (w + pads[1] + pads[3] - d * (k - 1) - 1) // s + 1
    r = torch.randn(n, c, ho, wo, generator=g) if has_r else None
    alpha, beta = {"Clip": (-0.5, 0.5), "LeakyRelu": (0.1, None)}.get(act, (None, None))
    run = native.depthwise_fn(native.DepthwiseWeight(wt), (s, s), (d, d), b, act, alpha, beta)
    out = torch.empty(n, ho, wo, c)
    nhwc = x.permute(0, 2, 3, 1).contiguous()
    rn = None if r is None else r.permute(0, 2, 3, 1).contiguous()
    run(nhwc, pads[:2], rn, out)
    _close(out.permute(0, 3, 1, 2), _reference(x, wt, b, r, pads, s, d, act))


@needs_native
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_depthwise_isas_agree_bit_for_bit(case):
    """AVX-512's blocks (shared input loads, 16 channels) sum each output's taps in the AVX2
    kernel's order after the bias: the same bits on either path, borders and tails included."""
    if "avx512" not in native.conv_isas():
        pytest.skip("this CPU has no AVX-512")
    n, c, h, w, k, pads, s, d, has_b, has_r, act = case
    x, wt, b, g = _data(n, c, h, w, k, seed=6)
    b = b if has_b else None
    ho = (h + pads[0] + pads[2] - d * (k - 1) - 1) // s + 1
    wo = (w + pads[1] + pads[3] - d * (k - 1) - 1) // s + 1
    r = torch.randn(n, ho, wo, c, generator=g) if has_r else None
    alpha, beta = {"Clip": (-0.5, 0.5), "LeakyRelu": (0.1, None)}.get(act, (None, None))
    run = native.depthwise_fn(native.DepthwiseWeight(wt), (s, s), (d, d), b, act, alpha, beta)
    nhwc = x.permute(0, 2, 3, 1).contiguous()
    outs = []
    try:
        for isa in ("avx2", "avx512"):
            native.set_conv_isa(isa)
            outs.append(run(nhwc, pads[:2], r, torch.empty(n, ho, wo, c)))
    finally:
        native.set_conv_isa(None)
    assert torch.equal(outs[0], outs[1])


@needs_native
def test_depthwise_checks_its_operands():
    run = native.depthwise_fn(native.DepthwiseWeight(torch.zeros(8, 1, 3, 3)), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="do not fit"):
        run(torch.zeros(1, 6, 6, 4), (1, 1), None, torch.empty(1, 6, 6, 8))  # 4 channels
    with pytest.raises(ValueError, match="do not fit"):
        run(torch.zeros(1, 6, 6, 8).transpose(1, 2), (1, 1), None, torch.empty(1, 6, 6, 8))
    with pytest.raises(ValueError, match="DepthwiseWeight"):
        native.DepthwiseWeight(torch.zeros(8, 2, 3, 3))


def _call(k, pads, stride, act="", res=False, c=16):
    a = FC.FusedConv.Attrs(kernel_shape=[k, k], pads=list(pads), strides=[stride] * 2,
                           dilations=[1, 1], group=c, layout="nhwc", activation=act,
                           alpha=0.0, beta=6.0, has_residual=int(res))
    return Call(a, n_out=1, n_in=4)


@needs_native
@pytest.mark.parametrize("tactic", ["", "kiln", "onednn"])
@pytest.mark.parametrize("pads", [(1, 1, 1, 1), (0, 0, 1, 1)], ids=["symmetric", "asymmetric"])
def test_fused_conv_depthwise_tactic(fresh, conv_isa, tactic, pads):
    """ONNX pads are (top, left, bottom, right); asymmetric ones run kiln's kernel whatever the
    pin (oneDNN's entry point here takes symmetric pads only)."""
    fresh.setattr(FCK, "_FORCED_CONV", tactic)
    x, w, b, _ = _data(1, 16, 9, 9, 3)
    x = x.contiguous(memory_format=CL)
    call = _call(3, pads, 2, "Clip")
    got = FCK.fused_conv(call, x, w, b)
    want = _reference(x, w, b, None, (pads[0], pads[1], pads[2], pads[3]), 2, 1, "")
    _close(got, want.clamp(0.0, 6.0))
    assert got.is_contiguous(memory_format=CL)
    (picked,) = call.cache["conv_tactics"].values()
    if pads[0] != pads[2]:
        assert picked == "kiln"
    elif tactic:
        assert picked == tactic
