"""kiln.native: the compiled AVX2 + FMA SGEMM (kiln/native/gemm.c) against torch in float64:
every tile, panel and K-block edge (``kiln.native.TILE``: the register tile's rows MR and
columns NR, the K block KC), bias and residual in registers, strided operands, every activation
it applies in registers, bad input, and the "kiln" tactic of the CPU linear in fused_conv.

Without the library (no C compiler at install, or a CPU without AVX2 + FMA) everything here
skips, except the check that it was built where it could have been."""

from __future__ import annotations

import platform
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops import fused_conv as FC

RTOL = 1e-5  # of max |reference|
F32_EPS = 2.0 ** -23
F32_MAX = 3.4028234663852886e38

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")


# ---------------------------------------------------------------- the library is there


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _could_build() -> bool:
    """Linux on x86-64, a CPU with AVX2 + FMA and a C compiler: ``pip install -e .`` builds it."""
    return (sys.platform.startswith("linux")
            and platform.machine().lower() in ("x86_64", "amd64")
            and {"avx2", "fma"} <= _cpu_flags()
            and bool(shutil.which("cc") or shutil.which("gcc")))


def test_library_built_where_it_can_be():
    if not _could_build():
        pytest.skip("not Linux x86-64 with AVX2 + FMA and a C compiler")
    assert native.available, native.why_not
    assert native.why_not == ""


# ---------------------------------------------------------------- helpers


@pytest.fixture
def threads():
    """Set torch's thread count (the kernel's) for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _act_ref(y, act, alpha=None, beta=None):
    """The torch reference of each kernel activation (on float64 ``y``)."""
    return {
        "": lambda y: y,
        "Relu": F.relu,
        "Gelu": F.gelu,
        "GeluTanh": lambda y: F.gelu(y, approximate="tanh"),
        "Sigmoid": torch.sigmoid,
        "Silu": F.silu,
        "Tanh": torch.tanh,
        "Clip": lambda y: y if alpha is None and beta is None else y.clamp(alpha, beta),
        "LeakyRelu": lambda y: F.leaky_relu(y, alpha),
        "HardSwish": F.hardswish,
        "HardSwishAffine": lambda y: alpha * F.hardswish(y) + beta,
    }[act](y)


def _reference(x, w, b=None, r=None, act="", alpha=None, beta=None):
    y = x.double() @ w.double()
    if b is not None:
        y = y + b.double()
    if r is not None:
        y = y + r.double()
    return _act_ref(y, act, alpha, beta)


def _close(got, want, rtol=RTOL, floor=0.0):
    """Max error within rtol of max |want|, or of ``floor`` where that is larger (a sum that
    cancels to near zero still carries the rounding of its terms)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == torch.float32
    err = float((got.double() - want).abs().max())
    scale = max(float(want.abs().max()), floor)
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol} * {scale:.3g}"


def _data(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(k, n, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    r = torch.randn(m, n, generator=g)
    return x, w, b, r


# ---------------------------------------------------------------- numerics: shapes


# The kernel's tile and K block (defaults where the library is missing: everything skips then)
MR, NR, KC = native.TILE or (4, 24, 1536)
# (M, N, K): each M in MS (a partial tile, full, full + 1, two and a bit, many), N in NS (a
# panel's masked first vector, a partial panel, full, full + 1, two and a bit, several), K in KS
# (one row, a few, one K block short / exact / one over, three blocks); 25 shapes stepping
# through the three lists at coprime strides, so that every value of each comes up
MS = (1, MR - 1, MR, MR + 1, 2 * MR + 1, 128, 200)
NS = (1, 7, NR - 1, NR, NR + 1, 2 * NR + 1, 100)
KS = (1, 3, KC - 1, KC, KC + 1, 2 * KC + 5)
SHAPES = [(MS[i % 7], NS[3 * i % 7], KS[5 * i % 6]) for i in range(25)]


@needs_native
def test_shapes_cover_every_edge():
    ms, ns, ks = (set(v) for v in zip(*SHAPES, strict=True))
    assert ms == set(MS) and ns == set(NS) and ks == set(KS)


@needs_native
@pytest.mark.parametrize("epi", ["plain", "bias", "residual", "bias+residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_torch(conv_isa, threads, shape, epi):
    m, n, k = shape
    x, w, b, r = _data(m, n, k)
    b = b if "bias" in epi else None
    r = r if "residual" in epi else None
    r_copy = None if r is None else r.clone()
    pw = native.PackedWeight(w)
    assert (pw.k, pw.n) == (k, n)
    want = _reference(x, w, b, r)
    # random-sign terms: float32 rounding grows like sqrt(K) of the terms' mean magnitude
    floor = float((x.double().abs() @ w.double().abs()).max()) / k ** 0.5
    outs = []
    # the large shapes split over threads (by panels, or by rows where panels are few); the
    # split never changes what one element's sum is, so every thread count gives the same bits
    for t in (1, 2, 3):
        threads(t)
        y = native.gemm(x, pw, b, r)
        _close(y, want, floor=floor)
        outs.append(y)
    assert all(torch.equal(y, outs[0]) for y in outs[1:])
    if r is not None:
        assert torch.equal(r, r_copy)  # the residual is read, never written


@needs_native
@pytest.mark.parametrize("m", [130, 49])
@pytest.mark.parametrize("n", [6 * NR + 16, 10 * NR + 8, 2 * NR + 16, 40 * NR, 3 * NR + 12,
                               NR + 20])
def test_uneven_panel_split(threads, n, m):
    """Panels that do not divide among the threads: the boundary panel's rows are split
    between two threads (7 panels on 2 threads: 3.5 each); 11 on 3; 3 (split by rows); 49
    rows, too few for 8-row blocks on every thread: panels, or rows and panels."""
    k = 64  # a partial row tile at the end
    x, w, b, r = _data(m, n, k, seed=2)
    pw = native.PackedWeight(w)
    want = _reference(x, w, b, r, "Relu")
    outs = []
    for t in (1, 2, 3, 4):
        threads(t)
        y = native.gemm(x, pw, b, r, "Relu")
        _close(y, want)
        outs.append(y)
    assert all(torch.equal(y, outs[0]) for y in outs[1:])


@needs_native
@pytest.mark.parametrize("m", [19, 49, 130])
@pytest.mark.parametrize("n", [NR, NR + 9, NR + 16, 2 * NR + 16, 3 * NR, 5 * NR + 8, 64, 128])
def test_lone_panels_and_edges_of_8_row_tiles(conv_isa, threads, m, n):
    """The panels that are not one of a pair of full ones (a lone full panel, edges of up to 16
    or 24 columns: 64 and 128 output channels end in them) over rows in tiles of 8 (the AVX-512
    single-panel tile where the CPU has it) and a partial tile: correct, and the same bits on
    any thread count."""
    x, w, b, r = _data(m, n, 37, seed=3)
    pw = native.PackedWeight(w)
    want = _reference(x, w, b, r, "Relu")
    outs = []
    for t in (1, 2, 3):
        threads(t)
        y = native.gemm(x, pw, b, r, "Relu")
        _close(y, want)
        outs.append(y)
    assert all(torch.equal(y, outs[0]) for y in outs[1:])


# ---------------------------------------------------------------- numerics: layouts


LAYOUT_SHAPES = [(7, 17, KC + 1), (13, 33, 2 * KC + 5), (200, 15, 3), (128, 100, KC), (1, 1, 1)]


@needs_native
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_strided_operands_and_out(threads, shape, nthreads):
    threads(nthreads)
    m, n, k = shape
    x, w, b, r = _data(m, n, k, seed=1)
    want = _reference(x, w, b, r, "Relu")
    # weight: a transposed view ([N, K] contiguous, read as [K, N]: strides (1, K))
    wt = w.t().contiguous().t()
    assert wt.stride() == (1, k)
    # a strided slice of a bigger tensor, neither dim unit stride
    big = torch.zeros(2 * k, 3 * n + 1)
    big[::2, 1::3] = w
    ws = big[::2, 1::3]
    assert ws.stride() == (2 * (3 * n + 1), 3)
    # x: rows of a wider tensor (row stride > K); residual likewise (row stride > N)
    xw = torch.full((m, k + 5), float("nan"))
    xw[:, 2:k + 2] = x
    xs = xw[:, 2:k + 2]
    assert xs.stride() == (k + 5, 1)
    rw = torch.full((m, n + 3), float("nan"))
    rw[:, 1:n + 1] = r
    rs = rw[:, 1:n + 1]
    for wv in (w, wt, ws):
        pw = native.PackedWeight(wv)
        _close(native.gemm(x, pw, b, r, "Relu"), want)
        _close(native.gemm(xs, pw, b, rs, "Relu"), want)
    # out= a column slice of a wider buffer (row stride > N): written in place, its
    # neighbours left alone
    pw = native.PackedWeight(wt)
    buf = torch.full((m, n + 9), -7.0)
    out = buf[:, 4:n + 4]
    got = native.gemm(xs, pw, b, rs, "Relu", out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(out, want)
    assert bool((buf[:, :4] == -7.0).all()) and bool((buf[:, n + 4:] == -7.0).all())
    # out= a plain contiguous tensor: overwritten whatever it held (K > KC accumulates into it
    # across K blocks, so stale contents would show)
    out2 = torch.full((m, n), 1e3)
    native.gemm(x, pw, b, r, "Relu", out=out2)
    _close(out2, want)


@needs_native
def test_packed_weight_owns_its_memory():
    x, w, b, _ = _data(6, 17, KC + 1)
    want = _reference(x, w, b)
    pw = native.PackedWeight(w)
    w.fill_(float("nan"))  # the source may go (engine pages are released after packing)
    del w
    _close(native.gemm(x, pw, b), want)
    assert pw.data.data_ptr() % 32 == 0  # panels are read with aligned loads


# ---------------------------------------------------------------- activations


# (activation, alpha, beta)
ACTS = [
    ("", None, None), ("Relu", None, None), ("Gelu", None, None), ("GeluTanh", None, None),
    ("Sigmoid", None, None), ("Silu", None, None), ("Tanh", None, None),
    ("Clip", -0.5, 0.7), ("Clip", None, None), ("Clip", None, 0.3), ("Clip", -0.3, None),
    ("LeakyRelu", 0.1, None), ("HardSwish", None, None), ("HardSwishAffine", 0.7, -0.2),
]


def _act_id(a):
    act, alpha, beta = a
    return f"{act or 'none'}({alpha},{beta})" if act in ("Clip", "LeakyRelu") else act or "none"


@needs_native
def test_every_activation_is_tested():
    assert {a for a, _, _ in ACTS} == set(native.ACTIVATIONS) == set(FC.ACTIVATIONS)


@needs_native
@pytest.mark.parametrize("shape", [(13, 33, KC + 1), (7, 15, 3), (128, 100, KC)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ACTS, ids=_act_id)
def test_activation_after_bias_and_residual(conv_isa, threads, act, shape):
    threads(2)
    name, alpha, beta = act
    m, n, k = shape
    x, w, b, r = _data(m, n, k, seed=2)
    x = x * 2  # spread the pre-activations over the activations' curved parts
    pw = native.PackedWeight(w)
    want = _reference(x, w, b, r, name, alpha, beta)
    # K = KC + 1 runs two K blocks: the activation applies once, to the whole sum
    _close(native.gemm(x, pw, b, r, name, alpha, beta), want)


def _wide_tolerance(want):
    """1e-6 absolute, plus one float32 ulp of the value: the output is a float32, and where
    |y| > 8 its own rounding alone is worth up to 1e-6 (half an ulp above 16 is 9.5e-7). torch's
    float32 silu is 1.3e-6 off float64 near y = 14; the kernel is no worse."""
    return 1e-6 + F32_EPS * want.abs()


@needs_native
@pytest.mark.parametrize("width", [1, NR, 2 * NR + 16])  # a masked 1-column tile, a full one,
@pytest.mark.parametrize("act", ACTS, ids=_act_id)             # an AVX-512 pair and lone panel
def test_activation_wide_range(conv_isa, act, width):
    name, alpha, beta = act
    if name == "Clip" and alpha is not None and beta is not None:
        alpha, beta = -12.5, 20.25
    # every 1/1024 over [-30, 30] (exact in float32), the ends, and a few tiny ones
    x = torch.cat([torch.arange(-30 * 1024, 30 * 1024 + 1, dtype=torch.float32) / 1024,
                   torch.tensor([1e-7, -1e-7, 1e-30, -1e-30, 0.0, -0.0])])
    x = x[: x.numel() // width * width].reshape(-1, width)
    pw = native.PackedWeight(torch.eye(width))  # x @ I = x exactly
    got = native.gemm(x, pw, activation=name, alpha=alpha, beta=beta).double()
    want = _act_ref(x.double(), name, alpha, beta)
    err = (got - want).abs()
    bad = err > _wide_tolerance(want)
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} values off, worst {float(err.max()):.3g} at "
        f"x={float(x.reshape(-1)[int(err.argmax())]):.6g}")


@needs_native
@pytest.mark.parametrize("act", ACTS, ids=_act_id)
def test_nan_propagates(conv_isa, act):
    """A NaN sum stays NaN through every activation (as in torch): row 3's NaN reaches all of
    its NR + 5 outputs (NaN * 0 is NaN), over a full panel and a masked one."""
    name, alpha, beta = act
    n = NR + 5
    x = torch.zeros(7, n)
    x[3, 5] = float("nan")
    w = torch.eye(n)
    got = native.gemm(x, native.PackedWeight(w), activation=name, alpha=alpha, beta=beta)
    assert bool(got[3].isnan().all())
    assert int(got.isnan().sum()) == n  # and no other row


@needs_native
@pytest.mark.parametrize("shape", [(200, 64, 16), (57, 2 * NR + 16, 16), (64, 3 * NR + 5, 27),
                                   (24, 2 * NR, KC + 3), (64, NR + 16, 16), (41, 3 * NR + 12, 24),
                                   (48, NR + 9, KC + 2), (33, 4 * NR + 8, 16)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ACTS, ids=_act_id)
def test_isas_agree_bit_for_bit(threads, act, shape):
    """The AVX-512 tiles (their full-width epilogue: bias, residual, activation in zmm, masked
    column edges; and K over one block, where the epilogue adds C) give the AVX2 tiles' bits:
    narrow-K shapes of a mobile CNN's 1x1 convs, lone and paired panels (a full one with a
    partial one of 9-23 columns too), partial row tiles; an edge of 8 or fewer columns agrees
    to rounding (see below)."""
    if "avx512" not in native.conv_isas():
        pytest.skip("this CPU has no AVX-512")
    threads(2)
    name, alpha, beta = act
    m, n, k = shape
    x, w, b, r = _data(m, n, k, seed=5)
    x = x * 2
    pw = native.PackedWeight(w)
    outs = {}
    try:
        for isa in ("avx2", "avx512"):
            native.set_conv_isa(isa)
            outs[isa] = (native.gemm(x, pw, b, r, name, alpha, beta),
                         native.gemm(x, pw, None, None, name, alpha, beta))
    finally:
        native.set_conv_isa(None)
    _close(outs["avx512"][0], _reference(x, w, b, r, name, alpha, beta))
    # an edge panel of 8 or fewer columns is AVX2's tile_1 (two sums per row, even and odd k)
    # but an AVX-512 tile's in 8-row blocks (one sum in k order): there the two agree to
    # rounding; every other column to the bit
    edge = n - n % NR if 0 < n % NR <= 8 else n
    full_rows = m - m % 8
    for a, z in zip(outs["avx2"], outs["avx512"]):
        assert torch.equal(a[:, :edge].nan_to_num(7.0), z[:, :edge].nan_to_num(7.0))
        assert torch.equal(a[full_rows:].nan_to_num(7.0), z[full_rows:].nan_to_num(7.0))
        if edge < n:
            _close(z[:, edge:].nan_to_num(7.0), a[:, edge:].double().nan_to_num(7.0))


# ---------------------------------------------------------------- bad input


@needs_native
def test_wrong_k_raises_naming_the_shapes():
    pw = native.PackedWeight(torch.randn(8, 3))
    with pytest.raises(ValueError, match=r"x \(4, 7\).*\[8, 3\]"):
        native.gemm(torch.randn(4, 7), pw)
    with pytest.raises(ValueError, match=r"\(4, 8\)"):
        native.gemm(torch.randn(8, 4).t(), pw)  # K right but its elements not contiguous


@needs_native
@pytest.mark.parametrize("w", [torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 4, 3),
                               torch.randn(4)], ids=["float64", "3-D", "1-D"])
def test_packed_weight_rejects(w):
    with pytest.raises(ValueError, match="PackedWeight"):
        native.PackedWeight(w)


# ---------------------------------------------------------------- the "kiln" tactic


def _call(op, **attrs):
    return Call(op.Attrs(**attrs), n_out=1, n_in=4)


@pytest.fixture
def kiln_tactic(fresh):
    """``fresh`` (conftest) with "kiln" pinned, as KILN_CPU_LINEAR=kiln does."""
    fresh.setattr(FCK, "_FORCED", "kiln")
    return fresh


def _fused_attrs(act):
    name, alpha, beta = act
    if name == "Clip":  # the fusion pass writes absent bounds as -/+ FLT_MAX
        return name, -F32_MAX if alpha is None else alpha, F32_MAX if beta is None else beta
    return name, 0.0 if alpha is None else alpha, 0.0 if beta is None else beta


@needs_native
@pytest.mark.parametrize("res", ["none", "[N]", "[1,N]", "[S,N]", "full"])
@pytest.mark.parametrize("act", ACTS, ids=_act_id)
def test_kiln_tactic_fused_matmul(kiln_tactic, threads, act, res):
    threads(2)
    name, alpha, beta = _fused_attrs(act)
    bsz, s, k, n_out = 2, 7, 40, 17
    g = torch.Generator().manual_seed(3)
    x = torch.randn(bsz, s, k, generator=g) * 2
    w = torch.randn(k, n_out, generator=g) / k ** 0.5
    b = torch.randn(n_out, generator=g)
    r = {"none": None, "[N]": torch.randn(n_out, generator=g),
         "[1,N]": torch.randn(1, n_out, generator=g),
         "[S,N]": torch.randn(s, n_out, generator=g),  # broadcasts over the batch
         "full": torch.randn(bsz, s, n_out, generator=g)}[res]
    r_copy = None if r is None else r.clone()
    n = _call(FC.FusedMatMul, activation=name, alpha=alpha, beta=beta,
              has_residual=int(r is not None))
    want = _reference(x, w, b, r, name, alpha, beta)
    first = FCK.fused_matmul(n, x, w, b, r)
    second = FCK.fused_matmul(n, x, w, b, r)  # the cached plan
    _close(first, want)
    assert torch.equal(first, second)
    assert list(n.cache["lin_tactics"].values()) == ["kiln"]
    if r is not None:
        assert torch.equal(r, r_copy)  # the residual input is never written


@needs_native
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("res", ["none", "row", "full"])
def test_kiln_tactic_fused_gemm(kiln_tactic, trans_b, res):
    g = torch.Generator().manual_seed(4)
    m, k, n_out = 13, KC + 1, 33
    a_in = torch.randn(m, k, generator=g)
    w = torch.randn(k, n_out, generator=g) / k ** 0.5
    c = torch.randn(n_out, generator=g)
    r = {"none": None, "row": torch.randn(1, n_out, generator=g),
         "full": torch.randn(m, n_out, generator=g)}[res]
    b_in = w.t().contiguous() if trans_b else w
    n = _call(FC.FusedGemm, transB=trans_b, activation="Gelu", has_residual=int(r is not None))
    want = _reference(a_in, w, c, r, "Gelu")
    for _ in range(2):
        _close(FCK.fused_gemm(n, a_in, b_in, c, r), want)
    assert list(n.cache["lin_tactics"].values()) == ["kiln"]


@needs_native
def test_kiln_tactic_noncontiguous_input(kiln_tactic):
    """x whose last dim is not contiguous, and a residual of the output's shape that is not."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 24, 5, generator=g).transpose(1, 2)  # [2, 5, 24], stride(2) != 1
    w = torch.randn(24, 16, generator=g)
    b = torch.randn(16, generator=g)
    r = torch.randn(2, 16, 5, generator=g).transpose(1, 2)  # [2, 5, 16], stride(2) != 1
    n = _call(FC.FusedMatMul, activation="Silu", has_residual=1)
    want = _reference(x, w, b, r, "Silu")
    for _ in range(2):
        _close(FCK.fused_matmul(n, x, w, b, r), want)
    assert list(n.cache["lin_tactics"].values()) == ["kiln"]


@needs_native
def test_gemm_fn_binds_the_epilogue_and_checks_each_run():
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(10, 7, generator=g), torch.randn(7, generator=g)
    x, r = torch.randn(5, 10, generator=g), torch.randn(5, 7, generator=g)
    run = native.gemm_fn(native.PackedWeight(w), b, "Relu")
    out = torch.empty(5, 7)
    assert run(x, r, out) is out
    want = (x.double() @ w.double() + b.double() + r.double()).relu()
    assert float((out.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    with pytest.raises(ValueError, match=r"x \(5, 9\)"):
        run(torch.randn(5, 9), None, out)
    with pytest.raises(ValueError, match=r"out \(5, 6\)"):
        run(x, None, torch.empty(5, 6))
    with pytest.raises(ValueError, match=r"bias \(6,\)"):
        native.gemm_fn(native.PackedWeight(w), torch.randn(6))
