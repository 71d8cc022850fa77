"""kiln.native's Winograd F(2x2, 3x3) convolution (``kiln_wino3x3`` in kiln/native/winograd.c)
against torch's in float64, and the CPU convolution tactics of FusedConv (oneDNN, or kiln's own
kernel: the GEMM for unpadded 1x1 convs, Winograd for 3x3 stride-1 ones) against F.conv2d:
every tactic agrees, kiln's applies only where it can, and the pick is kept per node and input
shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops import fused_conv as FC
from kiln.perf.layers import picked_tactic

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
CL = torch.channels_last
# Winograd's transforms add a few roundings to each product: within this of max |reference|
# (F(2x2, 3x3)'s error in float32 measured 1e-7 to 4e-7 on these shapes, 2.4e-6 on C = 512)
RTOL = 1e-5


def _act(y, act, alpha=0.0, beta=0.0):
    return {"": lambda y: y, "Relu": F.relu, "Clip": lambda y: y.clamp(alpha, beta),
            "LeakyRelu": lambda y: F.leaky_relu(y, alpha), "Gelu": F.gelu,
            "Sigmoid": torch.sigmoid, "HardSwish": F.hardswish}[act](y)


def _reference(x, w, b, r, pad, act, alpha=0.0, beta=0.0, stride=1, groups=1):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride=stride,
                 padding=pad, groups=groups)
    if r is not None:
        y = y + r.double()
    return _act(y, act, alpha, beta)


def _close(got, want, rtol=RTOL):
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = float((got.double() - want).abs().max()), float(want.abs().max())
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol} * {scale:.3g}"


def _data(n, c, k, h, w, kh=3, seed=0, groups=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(k, c // groups, kh, kh, generator=g) / (c * kh * kh) ** 0.5
    return x, wt, torch.randn(k, generator=g), g


# ---------------------------------------------------------------- the Winograd kernel


def _wino(x, w, b, r, pad, act="", alpha=None, beta=None):
    """kiln's Winograd conv of NCHW tensors (converted to NHWC and back)."""
    n, _, h, wd = x.shape
    out = torch.empty(n, h + 2 * pad[0] - 2, wd + 2 * pad[1] - 2, w.shape[0])
    run = native.conv3x3_fn(native.WinogradWeight(w), b, act, alpha, beta)

    def nhwc(t):
        return None if t is None else t.permute(0, 2, 3, 1).contiguous()

    return run(nhwc(x), pad, nhwc(r), out).permute(0, 3, 1, 2)


WINO_CASES = [  # N, C, K, H, W, pad, residual, activation
    (1, 8, 16, 5, 7, (1, 1), False, "Relu"),
    (2, 16, 24, 6, 6, (1, 1), True, "Relu"),     # a residual, two images
    (1, 64, 64, 9, 4, (1, 1), True, ""),         # odd rows: a half tile at the bottom
    (1, 32, 40, 1, 1, (1, 1), False, "Clip"),    # one pixel, all padding around it
    (1, 8, 8, 6, 5, (0, 0), False, "LeakyRelu"), # no padding: 4 x 3 out
    (2, 8, 16, 7, 7, (2, 1), True, "Gelu"),      # more padding than the kernel needs
    (1, 8, 8, 66, 66, (1, 1), False, "Sigmoid"), # 1089 tiles: more than one tile block
    (2, 256, 256, 20, 20, (1, 1), True, "Relu"),  # 200 tiles in blocks of 32: one spans both images
]


@needs_native
@pytest.mark.parametrize("case", WINO_CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_winograd_matches_torch(conv_isa, case):
    n, c, k, h, w, pad, res, act = case
    x, wt, b, g = _data(n, c, k, h, w)
    ho, wo = h + 2 * pad[0] - 2, w + 2 * pad[1] - 2
    r = torch.randn(n, k, ho, wo, generator=g) if res else None
    alpha, beta = {"Clip": (-0.5, 0.5), "LeakyRelu": (0.1, None)}.get(act, (None, None))
    want = _reference(x, wt, b, r, pad, act, alpha or 0.0, beta or 0.0)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):  # tiles and GEMM panels split differently; each sum is the same
            torch.set_num_threads(t)
            outs.append(_wino(x, wt, b, r, pad, act, alpha, beta))
    finally:
        torch.set_num_threads(before)
    _close(outs[0], want)
    assert all(torch.equal(y, outs[0]) for y in outs[1:])


@needs_native
def test_winograd_without_bias_and_large_values():
    x, wt, _, _ = _data(1, 16, 16, 8, 8, seed=3)
    x = x * 1e4  # the transforms only add and subtract: the relative error stays
    _close(_wino(x, wt, None, None, (1, 1)), _reference(x, wt, None, None, (1, 1), ""))


@needs_native
@pytest.mark.parametrize("shape", [(8, 12, 3, 3), (12, 8, 3, 3), (8, 8, 1, 1), (8, 8, 3)])
def test_winograd_weight_rejects(shape):
    with pytest.raises(ValueError, match="WinogradWeight: .*multiples of 8"):
        native.WinogradWeight(torch.zeros(shape))


@needs_native
def test_winograd_run_checks_its_operands():
    run = native.conv3x3_fn(native.WinogradWeight(torch.zeros(8, 8, 3, 3)))
    x = torch.zeros(1, 6, 6, 8)
    with pytest.raises(ValueError, match=r"conv3x3: x \(1, 6, 6, 16\)"):
        run(torch.zeros(1, 6, 6, 16), (1, 1), None, torch.empty(1, 6, 6, 8))  # C 16, not 8
    with pytest.raises(ValueError, match="do not fit"):
        run(x, (1, 1), None, torch.empty(1, 3, 6, 8))  # 3 rows out: a bottom pad of -2
    with pytest.raises(ValueError, match="do not fit"):
        run(x, (1, 1), torch.zeros(1, 5, 6, 8), torch.empty(1, 6, 6, 8))  # residual's shape
    with pytest.raises(ValueError, match="bias"):
        native.conv3x3_fn(native.WinogradWeight(torch.zeros(8, 8, 3, 3)), torch.zeros(16))


# ---------------------------------------------------------------- FusedConv's CPU tactics


def _conv_call(kh, pad, stride=1, act="", res=False, groups=1, alpha=0.0, beta=0.0):
    a = FC.FusedConv.Attrs(kernel_shape=[kh, kh], pads=[pad] * 4, strides=[stride] * 2,
                           dilations=[1, 1], group=groups, layout="nhwc", activation=act,
                           alpha=alpha, beta=beta, has_residual=int(res))
    return Call(a, n_out=1, n_in=4)


CONV_CASES = [  # N, C, K, H, kernel, pad, stride, groups, residual, activation; kiln applies?
    ((1, 16, 40, 9, 1, 0, 1, 1, False, "Relu"), True),   # 1x1: the GEMM
    ((2, 32, 24, 7, 1, 0, 1, 1, True, "Relu"), True),    # 1x1 + residual
    ((1, 16, 32, 8, 3, 1, 1, 1, False, "Clip"), True),   # 3x3: Winograd
    ((2, 8, 16, 7, 3, 1, 1, 1, True, ""), True),         # 3x3 + residual, odd size
    ((1, 8, 8, 6, 3, 0, 1, 1, False, "Relu"), True),     # 3x3 without padding
    ((1, 16, 16, 8, 3, 1, 2, 1, False, "Relu"), True),   # stride 2: the direct conv
    ((1, 16, 16, 8, 1, 0, 2, 1, False, ""), True),       # 1x1 stride 2: gathered, the GEMM
    ((2, 16, 24, 7, 1, 0, 2, 1, True, "Relu"), True),    # ... odd size, residual
    ((1, 16, 16, 8, 1, 1, 1, 1, False, ""), True),       # 1x1 with padding: direct
    ((1, 12, 16, 6, 3, 1, 1, 1, False, "Relu"), True),   # 12 channels: direct, not Winograd
    ((1, 16, 16, 6, 3, 1, 1, 2, False, ""), False),      # grouped: oneDNN
    ((1, 3, 8, 9, 5, 2, 1, 1, False, "Relu"), True),     # 5x5: direct
    ((2, 3, 16, 9, 3, 1, 2, 1, True, "HardSwish"), True),  # a stem + residual: direct
]


@needs_native
@pytest.mark.parametrize("tactic", [*FCK.CONV_TACTICS, "select"])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "-".join(map(str, c[0][:8])))
def test_fused_conv_tactics(fresh, conv_isa, tactic, case):
    (n, c, k, h, kh, pad, stride, groups, res, act), kiln_applies = case
    fresh.setattr(FCK, "_FORCED_CONV", "" if tactic == "select" else tactic)
    x, w, b, g = _data(n, c, k, h, h, kh=kh, groups=groups)
    x = x.contiguous(memory_format=CL)
    ho = (h + 2 * pad - kh) // stride + 1
    r = torch.randn(n, k, ho, ho, generator=g).contiguous(memory_format=CL) if res else None
    r_copy = None if r is None else r.clone()
    alpha, beta = (-0.5, 0.5) if act == "Clip" else (0.0, 0.0)
    call = _conv_call(kh, pad, stride, act, res, groups, alpha, beta)
    want = _reference(x, w, b, r, pad, act, alpha, beta, stride, groups)
    first = FCK.fused_conv(call, x, w, b, r)
    second = FCK.fused_conv(call, x, w, b, r)
    _close(first, want)
    _close(second, want)
    assert first.is_contiguous(memory_format=CL)  # the next conv takes it as it is
    assert torch.equal(first, second) or tactic == "select"  # a pick runs the same way again
    if r is not None:
        assert torch.equal(r, r_copy)  # the residual input is never written
    (key, picked), = call.cache["conv_tactics"].items()
    assert key == (tuple(x.shape), None if r is None else tuple(r.shape))
    if tactic == "select":
        assert picked in FCK.CONV_TACTICS
    if not kiln_applies:
        assert picked == "onednn"
    elif tactic != "select":
        assert picked == tactic


@needs_native
def test_conv_pick_is_per_shape_and_drops_onednn_weight(fresh):
    fresh.setattr(FCK, "_FORCED_CONV", "kiln")
    x, w, b, _ = _data(1, 16, 16, 8, 8)
    call = _conv_call(3, 1, act="Relu")
    for hw in (8, 10):
        xi = torch.randn(1, 16, hw, hw).contiguous(memory_format=CL)
        _close(FCK.fused_conv(call, xi, w, b), _reference(xi, w, b, None, 1, "Relu"))
    assert set(call.cache["conv_tactics"].values()) == {"kiln"}
    assert len(call.cache["conv_tactics"]) == 2
    assert not call.cache.get("packed")  # no oneDNN copy of the weight is kept for kiln's
    assert picked_tactic(call) == "kiln"  # what kiln bench --dump-profile prints
    assert picked_tactic(_conv_call(3, 1)) == ""  # not run yet


@needs_native
def test_conv_nearby_shape_reuses_the_timed_pick(fresh):
    """A conv at a batch x pixels within NEAREST_WITHIN of a timed shape takes its pick
    untimed; the builder's tuning run (record_picks) times it all the same."""
    fresh.setattr(FCK, "NEAREST_WITHIN", 8.0)
    calls = []
    real = FCK._select
    fresh.setattr(FCK, "_select",
                  lambda fns, x, r, *a: calls.append(tuple(x.shape)) or real(fns, x, r, *a))
    _, w, b, _ = _data(1, 16, 16, 8, 8)
    for n, hw in ((1, 8), (2, 8), (1, 12), (1, 40)):
        xi = torch.randn(n, 16, hw, hw).contiguous(memory_format=CL)
        got = FCK.fused_conv(_conv_call(3, 1, act="Relu"), xi, w, b)
        _close(got, _reference(xi, w, b, None, 1, "Relu"))
    assert calls == [(1, 16, 8, 8), (1, 16, 40, 40)]  # 40x40: 25x the pixels of 8x8
    with FCK.record_picks() as picks:
        xi = torch.randn(2, 16, 8, 8).contiguous(memory_format=CL)
        FCK.fused_conv(_conv_call(3, 1, act="Relu"), xi, w, b)
    assert calls[-1] == (2, 16, 8, 8) and len(picks) == 1


def test_conv_pin_must_be_known(fresh):
    fresh.setattr(FCK, "_FORCED_CONV", "fast")
    x, w, b, _ = _data(1, 8, 8, 6, 6)
    with pytest.raises(ValueError, match="KILN_CPU_CONV='fast': expected one of onednn, kiln"):
        FCK.fused_conv(_conv_call(3, 1), x.contiguous(memory_format=CL), w, b)


@needs_native
def test_conv_plan_fill_is_thread_safe(fresh, concurrently):
    """Threads running one node at once (a server's contexts): one plan per shape, every output
    right, whichever thread planned it."""
    _, w, b, _ = _data(1, 16, 16, 8, 8)
    call = _conv_call(3, 1, act="Relu")
    xs = [torch.randn(1, 16, 6 + 2 * (i % 2), 6 + 2 * (i % 2)).contiguous(memory_format=CL)
          for i in range(8)]
    outs = [None] * len(xs)

    def work(i):
        outs[i] = FCK.fused_conv(call, xs[i], w, b)

    concurrently(work, len(xs))
    for xi, y in zip(xs, outs, strict=True):
        _close(y, _reference(xi, w, b, None, 1, "Relu"))
    assert len(call.cache["conv_plans"]) == 2  # two input shapes


def test_select_credit_counts_against_the_measured_time():
    """_select's credit: a candidate credited more than it is slower wins (a kiln conv in a
    native program costs less than its timed Python call); without it the faster one does."""
    import time

    def slow(x, r):
        time.sleep(0.003)
        return x

    def fast(x, r):
        time.sleep(0.001)
        return x

    x = torch.ones(4)
    fns = {"onednn": fast, "kiln": slow}
    assert FCK._select(fns, x, None, FCK.CONV_TACTICS)[0] == "onednn"
    assert FCK._select(fns, x, None, FCK.CONV_TACTICS, {"kiln": 0.01})[0] == "kiln"
