"""kiln.native's direct convolution (``kiln_conv`` in kiln/native/conv.c) against torch's conv2d
in float64: stems (3 input channels, stride 2), pads per side, dilation, output channels that
are not whole vectors or groups of three, bias, residual, activations; and FusedConv's tactic
that runs it (timed against oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops import fused_conv as FC

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
RTOL = 1e-5
ACTS = {"": lambda y: y, "Relu": F.relu, "HardSwish": F.hardswish, "Silu": F.silu,
        "Clip": lambda y: y.clamp(-0.5, 0.5)}

CASES = [  # N, C, K, H, W, kernel, pads (t, l, b, r), stride, dilation, bias, residual, act
    (1, 3, 16, 33, 35, 3, (1, 1, 1, 1), 2, 1, True, False, "HardSwish"),  # a stem
    (2, 3, 24, 16, 20, 3, (0, 0, 1, 1), 2, 1, True, False, "Relu"),       # TF "same" stem
    (1, 8, 13, 9, 23, 3, (1, 1, 1, 1), 1, 1, False, True, ""),            # 13 out: a tail
    (1, 5, 40, 11, 14, 5, (2, 1, 2, 3), 1, 1, True, True, "Silu"),        # 5 vectors
    (1, 4, 8, 10, 12, 3, (2, 2, 2, 2), 1, 2, True, False, "Clip"),        # dilation 2
    (1, 16, 32, 7, 9, (1, 7), (0, 3, 0, 3), 1, 1, True, False, "Relu"),   # 1 x 7
    (1, 2, 8, 4, 3, 7, (3, 3, 3, 3), 1, 1, True, False, ""),              # wider than input
    # windows of fewer than 32 values: the register-block kernel
    (1, 1, 8, 12, 11, 3, (2, 2, 2, 2), 1, 2, True, True, "Relu"),         # 1 channel, dil 2
    (2, 1, 13, 9, 10, 5, (1, 2, 2, 1), 2, 1, False, False, "Silu"),       # 25 values
    # im2col + kiln's GEMM: in blocks of rows, or gathered whole (few rows, threaded product)
    (1, 16, 48, 40, 40, 3, (1, 1, 1, 1), 1, 1, True, True, "Relu"),       # many blocks
    (2, 32, 24, 20, 18, 3, (1, 0, 1, 2), 2, 1, True, True, "HardSwish"),  # s2, asym pads
    (1, 64, 40, 9, 9, 3, (1, 1, 1, 1), 2, 1, True, False, "Relu"),        # few rows, whole
    (1, 96, 56, 7, 7, 3, (1, 1, 1, 1), 1, 1, False, True, ""),            # 49 rows, 3 panels
    (1, 12, 1, 10, 10, 3, (1, 1, 1, 1), 1, 1, True, False, "HardSwish"),  # one output channel
    (1, 3, 64, 45, 45, 7, (3, 3, 3, 3), 2, 1, True, False, "Relu"),       # a 7 x 7 stem
    (1, 10, 29, 13, 15, (3, 2), (1, 0, 2, 1), (2, 1), (2, 1), True, True, "Silu"),  # mixed
    # the 3-channel 3x3 blocks (AVX-512: 12 pixels x 32 channels, 16 x 16; AVX2: 4 x 24, 6 x
    # 16, 8 x 8), rows long enough for whole blocks and their 4- and 1-pixel remainders
    (1, 3, 32, 40, 61, 3, (1, 1, 1, 1), 2, 1, True, False, "Relu"),       # 32: one group
    (1, 3, 24, 9, 77, 3, (1, 1, 1, 1), 2, 1, True, True, "HardSwish"),    # 24: masked zmm
    (1, 3, 48, 7, 50, 3, (0, 0, 1, 1), 2, 1, True, True, "Silu"),         # 32 + 16
    (2, 3, 40, 6, 38, 3, (1, 1, 1, 1), 1, 1, False, True, "Clip"),        # 32 + 8, stride 1
    (1, 3, 16, 5, 70, 3, (1, 1, 1, 1), 2, 1, True, False, ""),            # 16 pixels x 16
    (1, 3, 8, 5, 40, 3, (1, 1, 1, 1), 1, 1, True, False, "Relu"),         # one vector
    (1, 2, 20, 6, 45, 3, (1, 1, 1, 1), 1, 1, True, True, "Relu"),         # window of 18
]


def _reference(x, w, b, r, pads, stride, dil, act):
    t, left, bot, right = pads
    y = F.conv2d(F.pad(x.double(), (left, right, t, bot)), w.double(),
                 None if b is None else b.double(), stride=stride, dilation=dil)
    return ACTS[act](y if r is None else y + r.double())


@needs_native
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])))
def test_direct_conv_matches_torch(conv_isa, case):
    n, c, k, h, w, ks, pads, s, d, has_b, has_r, act = case
    kh, kw = (ks, ks) if isinstance(ks, int) else ks
    (sh, sw), (dh, dw) = [(v, v) if isinstance(v, int) else v for v in (s, d)]
    g = torch.Generator().manual_seed(0)
    x, wt = torch.randn(n, c, h, w, generator=g), torch.randn(k, c, kh, kw, generator=g)
    b = torch.randn(k, generator=g) if has_b else None
    ho = (h + pads[0] + pads[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (w + pads[1] + pads[3] - dw * (kw - 1) - 1) // sw + 1
    r = torch.randn(n, k, ho, wo, generator=g) if has_r else None
    alpha, beta = (-0.5, 0.5) if act == "Clip" else (None, None)
    run = native.conv_fn(native.ConvWeight(wt), (sh, sw), (dh, dw), b, act, alpha, beta)
    out = torch.empty(n, ho, wo, k)
    rn = None if r is None else r.permute(0, 2, 3, 1).contiguous()
    run(x.permute(0, 2, 3, 1).contiguous(), pads[:2], rn, out)
    want = _reference(x, wt, b, r, pads, (sh, sw), (dh, dw), act)
    got = out.permute(0, 3, 1, 2).double()
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= RTOL * float(want.abs().max())


@needs_native
@pytest.mark.parametrize("case", [c for c in CASES if c[1] * (c[5] ** 2 if isinstance(c[5], int)
                                                          else c[5][0] * c[5][1]) < 32],
                         ids=lambda c: "-".join(map(str, c[:9])))
def test_direct_conv_isas_agree_bit_for_bit(case):
    """The register-block kernel's AVX-512 blocks (windows of fewer than 32 values; larger ones
    are im2col + the GEMM) sum each output's taps in the AVX2 blocks' order (then the bias, the
    residual, the activation): the same bits on either path."""
    if "avx512" not in native.conv_isas():
        pytest.skip("this CPU has no AVX-512")
    n, c, k, h, w, ks, pads, s, d, has_b, has_r, act = case
    kh, kw = (ks, ks) if isinstance(ks, int) else ks
    (sh, sw), (dh, dw) = [(v, v) if isinstance(v, int) else v for v in (s, d)]
    g = torch.Generator().manual_seed(4)
    x, wt = torch.randn(n, h, w, c, generator=g), torch.randn(k, c, kh, kw, generator=g)
    b = torch.randn(k, generator=g) if has_b else None
    ho = (h + pads[0] + pads[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (w + pads[1] + pads[3] - dw * (kw - 1) - 1) // sw + 1
    r = torch.randn(n, ho, wo, k, generator=g) if has_r else None
    alpha, beta = (-0.5, 0.5) if act == "Clip" else (None, None)
    run = native.conv_fn(native.ConvWeight(wt), (sh, sw), (dh, dw), b, act, alpha, beta)
    outs = []
    try:
        for isa in ("avx2", "avx512"):
            native.set_conv_isa(isa)
            outs.append(run(x, pads[:2], r, torch.empty(n, ho, wo, k)))
    finally:
        native.set_conv_isa(None)
    assert torch.equal(outs[0], outs[1])


@needs_native
@pytest.mark.parametrize("hw", [(9, 9), (40, 40)], ids=["gathered-whole", "in-blocks"])
def test_direct_conv_im2col_bits_do_not_depend_on_threads(hw):
    """The im2col path gives the same bits on one thread as on two, whichever way it splits
    the work (rows gathered whole and the product's panels split, or blocks of rows)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, hw[0], hw[1], 64, generator=g)
    w, b = torch.randn(40, 64, 3, 3, generator=g), torch.randn(40, generator=g)
    run = native.conv_fn(native.ConvWeight(w), (2, 2), (1, 1), b, "Relu")
    ho, wo = (hw[0] - 1) // 2 + 1, (hw[1] - 1) // 2 + 1
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(run(x, (1, 1), None, torch.empty(1, ho, wo, 40)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@needs_native
def test_direct_conv_checks_its_operands():
    run = native.conv_fn(native.ConvWeight(torch.zeros(8, 3, 3, 3)), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="do not fit"):
        run(torch.zeros(1, 5, 5, 4), (1, 1), None, torch.zeros(1, 5, 5, 8))


@needs_native
def test_fused_conv_stem_runs_kilns_direct_conv_where_it_wins(monkeypatch):
    """FusedConv's tactic for a stem conv: kiln's direct conv when forced (and when it is the
    faster), with the same output as oneDNN's."""
    monkeypatch.setattr(FCK, "_FORCED_CONV", "kiln")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 30, 31, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(16, 3, 3, 3, generator=g), torch.randn(16, generator=g)
    attrs = FC.FusedConv.make_attrs(kernel_shape=(3, 3), pads=(1, 1, 1, 1), strides=(2, 2),
                                    layout="nhwc", activation="HardSwish")
    call = Call(attrs, n_out=1, n_in=3)
    y = FCK.fused_conv(call, x, w, b)
    assert set(call.cache["conv_tactics"].values()) == {"kiln"}
    want = F.hardswish(F.conv2d(x, w, b, stride=2, padding=1))
    assert float((y - want).abs().max()) <= 1e-5 * float(want.abs().max())
