"""The CPU linear tactics (F.linear, MKL packed, oneDNN packed with fused post-ops) of
FusedMatMul / FusedGemm / Gemm: every tactic agrees with F.linear, the pick is cached per node
and input shape, and the cache fill is thread-safe."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.kernels.torch import nn_norm
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N

RTOL = 1e-5


def _call(op, **attrs):
    return Call(op.Attrs(**attrs), n_out=1, n_in=4)


def _close(got, want):
    assert got.shape == want.shape
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= RTOL * scale, float((got - want).abs().max())


def _reference(x, w, b, act, r, alpha=0.0, beta=0.0):
    y = x.double() @ w.double()
    if b is not None:
        y = y + b.double()
    if r is not None:
        y = y + r.double()
    return {"": lambda y: y, "Relu": F.relu, "Gelu": F.gelu,
            "GeluTanh": lambda y: F.gelu(y, approximate="tanh"),
            "Clip": lambda y: y.clamp(alpha, beta), "Sigmoid": torch.sigmoid}[act](y)


CASES = [  # x shape (its last dim K), K, N, activation, residual, bias
    ((1, 16, 32), 32, 48, "", False, True),
    ((2, 16, 32), 32, 32, "", True, True),
    ((1, 16, 32), 32, 96, "Gelu", False, True),
    ((3, 7, 24), 24, 40, "GeluTanh", False, True),
    ((2, 16, 64), 64, 32, "Relu", True, True),
    ((16, 32), 32, 24, "Clip", False, False),
    ((2, 5, 16), 16, 8, "Sigmoid", False, True),
]


@pytest.mark.parametrize("tactic", [*FCK.TACTICS, "select"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3] or 'none'}-r{int(c[4])}")
def test_fused_matmul_tactics(fresh, tactic, case):
    shape, k, n_out, act, res, bias = case
    fresh.setattr(FCK, "_FORCED", "" if tactic == "select" else tactic)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(k, n_out, generator=g) / k ** 0.5
    b = torch.randn(n_out, generator=g) if bias else None
    r = torch.randn(*x.shape[:-1], n_out, generator=g) if res else None
    r_copy = None if r is None else r.clone()
    alpha, beta = (-0.5, 0.5) if act == "Clip" else (0.0, 0.0)
    n = _call(FC.FusedMatMul, activation=act, alpha=alpha, beta=beta, has_residual=int(res))
    want = _reference(x, w, b, act, r, alpha, beta)
    first = FCK.fused_matmul(n, x, w, b, r)
    second = FCK.fused_matmul(n, x, w, b, r)
    _close(first.double(), want)
    _close(second.double(), want)
    assert torch.equal(first, second) or tactic == "select"  # a pick runs the same way again
    assert torch.equal(FCK.fused_matmul(n, x, w, b, r), second)
    if r is not None:
        assert torch.equal(r, r_copy)  # the residual input is never written
    (key, picked), = n.cache["lin_tactics"].items()
    assert picked in FCK.TACTICS
    if tactic != "select":
        fused_ok = act or res
        assert picked == (tactic if tactic != "onednn_fused" or fused_ok else "linear") or \
            not (FCK._HAVE_ONEDNN and FCK._HAVE_MKL) or \
            (tactic == "kiln" and not native.available and picked == "linear")


def test_plans_per_shape_and_weight_kept_plain(fresh):
    n = _call(FC.FusedMatMul)
    w = torch.randn(32, 16)
    for m in (4, 8, 4, 12):
        x = torch.randn(m, 32)
        _close(FCK.fused_matmul(n, x, w).double(), x.double() @ w.double())
    assert set(n.cache["lin_plans"]) == {((4, 32), None), ((8, 32), None), ((12, 32), None)}
    assert "wt" not in n.cache and n.cache["lin_src"] is w  # no transposed copy kept
    assert not n.cache.get("lin_dynamic")


def test_choice_shared_across_nodes_of_one_signature(fresh):
    calls = []
    real = FCK._select
    fresh.setattr(FCK, "_select", lambda fns, x, r, *a: calls.append(1) or real(fns, x, r, *a))
    x = torch.randn(2, 8, 32)
    nodes = [_call(FC.FusedMatMul) for _ in range(3)]
    for nd in nodes:
        FCK.fused_matmul(nd, x, torch.randn(32, 64))
    assert len(calls) == 1
    assert len({tuple(nd.cache["lin_tactics"].values()) for nd in nodes}) == 1


@pytest.mark.parametrize("res", [False, True])
def test_wide_weight_is_timed_on_a_slice(fresh, res):
    """A weight with more output features than _SLICE_N (GPT-2's LM head) is timed on its first
    _SLICE_N: the candidates pack only those; the pick then packs the whole weight."""
    fresh.setattr(FCK, "_SLICE_N", 16)
    seen = []
    real = FCK._build
    fresh.setattr(FCK, "_build", lambda name, x, wt, *rest: seen.append((name, wt.shape[0]))
                  or real(name, x, wt, *rest))
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(3, 8, 32, generator=g), torch.randn(32, 40, generator=g), torch.randn(40)
    r = torch.randn(3, 8, 40, generator=g) if res else None
    n = _call(FC.FusedMatMul, activation="Relu", has_residual=int(res))
    y = FCK.fused_matmul(n, x, w, b, r)
    _close(y.double(), _reference(x, w, b, "Relu", r))
    (picked,) = n.cache["lin_tactics"].values()
    timed = seen[:-1]
    assert {k for _, k in timed} == {16} and len(timed) >= 2  # every candidate on the slice
    assert seen[-1] == (picked, 40)  # then the pick, whole
    _close(FCK.fused_matmul(n, x, w, b, r).double(), _reference(x, w, b, "Relu", r))


def test_changing_weight_falls_back_to_plain(fresh):
    n = _call(FC.FusedGemm, transB=1)
    x = torch.randn(8, 16)
    for _ in range(3):
        w, c = torch.randn(24, 16), torch.randn(24)
        _close(FCK.fused_gemm(n, x, w, c).double(), x.double() @ w.double().t() + c.double())
    assert n.cache["lin_dynamic"]


def test_cache_fill_is_thread_safe(fresh, concurrently):
    n = _call(FC.FusedMatMul, activation="Gelu")
    w = torch.randn(64, 128) / 8
    xs = [torch.randn(2, 32, 64) for _ in range(8)]
    outs = [None] * len(xs)

    def work(i):
        outs[i] = FCK.fused_matmul(n, xs[i], w)

    concurrently(work, len(xs))
    for x, y in zip(xs, outs, strict=True):
        _close(y.double(), F.gelu(x.double() @ w.double()))
    assert len(n.cache["lin_plans"]) == 1


def test_switch_off_is_plain_linear(fresh):
    fresh.setattr(FCK, "PACKED_LINEAR", False)
    n = _call(FC.FusedMatMul)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    assert torch.equal(FCK.fused_matmul(n, x, w), F.linear(x, w.t()))
    assert "lin_plans" not in n.cache


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_kind", ["none", "scalar", "vector", "row", "matrix"])
def test_gemm(fresh, trans_b, c_kind):
    g = torch.Generator().manual_seed(1)
    m, k, n_out = 10, 24, 40
    a = torch.randn(m, k, generator=g)
    w = torch.randn(k, n_out, generator=g)
    c = {"none": None, "scalar": torch.tensor(0.25), "vector": torch.randn(n_out, generator=g),
         "row": torch.randn(1, n_out, generator=g),
         "matrix": torch.randn(m, n_out, generator=g)}[c_kind]
    n = _call(N.Gemm, transB=trans_b)
    b = w.t().contiguous() if trans_b else w
    want = a.double() @ w.double() + (0 if c is None else c.double())
    for _ in range(2):
        _close(nn_norm.gemm(n, a, b, c).double(), want)
    assert ("lin_plans" in n.cache) == (c_kind != "matrix")


def test_gemm_alpha_beta_keeps_generic_path(fresh):
    n = _call(N.Gemm, alpha=2.0, beta=0.5)
    a, b, c = torch.randn(4, 6), torch.randn(6, 5), torch.randn(5)
    _close(nn_norm.gemm(n, a, b, c).double(), 2 * a.double() @ b.double() + 0.5 * c.double())
    assert "lin_plans" not in n.cache


# ---- CUDA: F.linear reads a transposed view of the weight, no copy (run here on CPU tensors by
# pretending they are on the device)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_gemm_uses_weight_view(monkeypatch, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g).to(dtype)
    w = torch.randn(16, 24, generator=g).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    r = torch.randn(2, 5, 24, generator=g).to(dtype)
    x2 = x.reshape(10, 16)
    want_mm = FCK.fused_matmul(_call(FC.FusedMatMul, activation="Relu", has_residual=1),
                               x, w, b, r)
    want_gemm = FCK.fused_gemm(_call(FC.FusedGemm), x2, w, b)
    seen = []
    real = F.linear
    monkeypatch.setattr(FCK, "_on_cuda", lambda t: True)
    # CUDA tensors never take the CPU tactics (x.device.type != "cpu"); without this the
    # outcome would depend on which CPU tactic won the timing for this shape
    monkeypatch.setattr(FCK, "_linear_ok", lambda *a: False)
    monkeypatch.setattr(FCK.F, "linear", lambda x, wt, b=None: seen.append(wt) or real(x, wt, b))
    n_mm = _call(FC.FusedMatMul, activation="Relu", has_residual=1)
    n_gemm = _call(FC.FusedGemm)
    for _ in range(2):
        got_mm = FCK.fused_matmul(n_mm, x, w, b, r)
        got_gemm = FCK.fused_gemm(n_gemm, x2, w, b)
    assert "wt" not in n_mm.cache and "wt" not in n_gemm.cache  # no transposed copy kept
    assert seen and all(wt.data_ptr() == w.data_ptr() for wt in seen)  # views of w
    torch.testing.assert_close(got_mm, want_mm, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)
    torch.testing.assert_close(got_gemm, want_gemm, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)


def test_nearby_shape_reuses_the_timed_pick(fresh):
    """A shape within NEAREST_WITHIN rows of a timed one of the same layer takes its pick
    untimed (as TensorRT runs a profile's shapes on the opt shape's tactic); one further off
    is timed, and so is every shape the builder's tuning run meets (inside record_picks)."""
    fresh.setattr(FCK, "NEAREST_WITHIN", 8.0)
    calls = []
    real = FCK._select
    fresh.setattr(FCK, "_select", lambda fns, x, r, *a: calls.append(x.shape[0])
                  or real(fns, x, r, *a))
    w, w2 = torch.randn(32, 64), torch.randn(32, 48)
    for rows, wt in ((16, w), (4, w), (64, w), (3, w), (200, w), (16, w2)):
        n = _call(FC.FusedMatMul)
        x = torch.randn(rows, 32)
        _close(FCK.fused_matmul(n, x, wt), x @ wt)
    # 16 timed; 4, 64 and 3 within 8x of it; 200 is 12.5x from 16 and only timed picks are
    # anchors (64's reused pick is not); w2 is another layer
    assert calls == [16, 200, 16], calls
    assert FCK._signature(torch.empty(64, 32), w.t(), None, _call(FC.FusedMatMul).a,
                          None) not in FCK._choices
    with FCK.record_picks() as picks:
        x = torch.randn(32, 32)
        _close(FCK.fused_matmul(_call(FC.FusedMatMul), x, w), x @ w)
    assert calls[-1] == 32 and len(picks) == 1


@pytest.mark.skipif(not native.available, reason="kiln's C library is not built")
@pytest.mark.parametrize("program", ["1", "0"])
def test_linear_pick_credits_kiln_in_a_native_program(fresh, program):
    """Where native programs run, the timed pick credits kiln's GEMM with what a torch record
    of F.linear costs a program (LINEAR_PROGRAM_CREDIT_S): kiln slower than F.linear by less
    than that wins; with programs off (KILN_CPU_PROGRAM=0) the timing alone decides."""
    from kiln.settings import Settings

    fresh.setattr(FCK, "SETTINGS", Settings.from_env({"KILN_CPU_PROGRAM": program}))
    seen = []
    real = FCK._select

    def late(fn):  # kiln's GEMM, made slower than any rival by half the credit
        def run(x, r):
            t0 = time.perf_counter()
            y = fn(x, r)
            while time.perf_counter() - t0 < 0.5e-3:
                pass
            return y
        return run

    def select(fns, x, r, order=FCK.TACTICS, credit=None):
        seen.append(credit)
        fns = {k: late(f) if k == "kiln" else f for k, f in fns.items()}
        return real(fns, x, r, order, credit)

    fresh.setattr(FCK, "_select", select)
    fresh.setattr(FCK, "LINEAR_PROGRAM_CREDIT_S", 1e-3)  # kiln's handicap is 0.5 ms
    w, x = torch.randn(256, 96), torch.randn(1, 1, 256)
    n = _call(FC.FusedMatMul, activation="Silu")
    _close(FCK.fused_matmul(n, x, w), F.silu(x @ w))
    assert seen == [{"kiln": 1e-3} if program == "1" else None]
    picked = n.cache["lin_tactics"][((1, 1, 256), None)]
    assert (picked == "kiln") == (program == "1"), picked


def test_small_product_takes_kiln_untimed(fresh):
    """At most KILN_BELOW multiply-adds: kiln's GEMM, nothing timed, the pick shared by the
    signature; one more row and the tactics are timed."""
    fresh.setattr(FCK, "KILN_BELOW", 8 * 32 * 64)
    calls = []
    real = FCK._select
    fresh.setattr(FCK, "_select", lambda fns, x, r, *a: calls.append(1) or real(fns, x, r, *a))
    w = torch.randn(32, 64)
    for rows in (8, 8, 9):
        n = _call(FC.FusedMatMul)
        x = torch.randn(rows, 32)
        torch.testing.assert_close(FCK.fused_matmul(n, x, w), x @ w, rtol=1e-5, atol=1e-5)
        tactic = n.cache["lin_tactics"][((rows, 32), None)]
        assert tactic == "kiln" if rows == 8 else True
    assert len(calls) == 1  # the 9-row product only


def test_few_row_product_takes_kiln_untimed(fresh):
    """At most KILN_FEW_ROWS rows and KILN_FEW_ROWS_BELOW multiply-adds (a decoder step's
    products): kiln's GEMM untimed, however far above KILN_BELOW; one more row, or a larger
    product, is timed."""
    fresh.setattr(FCK, "KILN_FEW_ROWS_BELOW", 4 * 64 * 256)
    calls = []
    real = FCK._select
    fresh.setattr(FCK, "_select", lambda fns, x, r, *a: calls.append(tuple(x.shape)) or real(
        fns, x, r, *a))
    for rows, k in ((1, 64), (4, 64), (5, 64), (4, 128)):
        n = _call(FC.FusedMatMul, activation="Relu")
        x, w = torch.randn(1, rows, k), torch.randn(k, 256)
        _close(FCK.fused_matmul(n, x, w), torch.relu(x @ w))
        if rows * k <= 4 * 64:
            assert n.cache["lin_tactics"][((1, rows, k), None)] == "kiln"
    assert calls == [(1, 5, 64), (1, 4, 128)], calls
