"""kiln.native's elementwise kernel (kiln/native/pointwise.c) and pooling (pool.c) against
torch in float64: every op, broadcasting, strided operands and outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
RTOL = 2e-6  # of max |reference|: exp256 is ~1 ulp, tanh = 2 sigmoid(2x) - 1 adds a rounding

UNARY = {"Copy": lambda x: x, "Relu": F.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh,
         "Exp": torch.exp, "Neg": torch.neg, "Abs": torch.abs, "Sqrt": lambda x: x.abs().sqrt(),
         "Reciprocal": torch.reciprocal, "Silu": F.silu, "Gelu": F.gelu,
         "GeluTanh": lambda x: F.gelu(x, approximate="tanh"), "HardSwish": F.hardswish,
         "Clip": lambda x: x.clamp(-0.3, 0.4), "LeakyRelu": lambda x: F.leaky_relu(x, 0.2),
         "HardSigmoid": lambda x: (0.2 * x + 0.5).clamp(0, 1)}
PARAMS = {"Clip": (-0.3, 0.4), "LeakyRelu": (0.2, 0.0), "HardSigmoid": (0.2, 0.5)}
BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div,
          "Max": torch.maximum, "Min": torch.minimum,
          "PRelu": lambda a, b: torch.where(a < 0, a * b, a)}


def _close(got, want):
    assert got.shape == want.shape
    err, scale = float((got.double() - want).abs().max()), float(want.abs().max())
    assert err <= RTOL * scale, f"max error {err:.3g} > {RTOL} * {scale:.3g}"


@needs_native
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_matches_torch(op):
    x = torch.randn(3, 5, 7, 9, generator=torch.Generator().manual_seed(0)) * 3
    if op == "Sqrt":
        x = x.abs()
    if op == "Reciprocal":
        x = x.sign() * (x.abs() + 0.5)
    got = native.pointwise(op, x, None, *PARAMS.get(op, (0.0, 0.0)))
    _close(got, UNARY[op](x.double()))


@needs_native
@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("shapes", [((2, 3, 4, 5), (2, 3, 4, 5)), ((2, 3, 4, 5), (3, 1, 1)),
                                    ((1, 16, 1, 1), (2, 16, 7, 7)), ((5,), ()),
                                    ((4, 1, 6), (1, 3, 1))], ids=str)
def test_binary_broadcasts(op, shapes):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(s, generator=g) for s in shapes)
    if op == "Div":
        b = b.sign() * (b.abs() + 0.5)
    _close(native.pointwise(op, a, b), BINARY[op](a.double(), b.double()))


@needs_native
def test_strided_operands_and_output():
    """Transposed and channels-last inputs, a slice as the output (how Concat writes)."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 8, 5, 6, generator=g).contiguous(memory_format=torch.channels_last)
    b = torch.randn(6, 5, 8, generator=g).permute(2, 1, 0)  # [8, 5, 6], strided
    big = torch.zeros(2, 12, 5, 6)
    out = big[:, 2:10]
    native.pointwise("Mul", a, b, out=out)
    _close(out, a.double() * b.double())
    assert float(big[:, :2].abs().max()) == 0 and float(big[:, 10:].abs().max()) == 0
    _close(native.pointwise("Tanh", a.transpose(1, 3)), torch.tanh(a.transpose(1, 3).double()))


@needs_native
@pytest.mark.parametrize("perm", [(0, 2, 3, 1), (0, 3, 1, 2), (3, 2, 1, 0), (1, 0, 2, 3)])
def test_output_layout_sets_the_walk(perm):
    """Outputs of every memory order (the kernel walks y's contiguous dim innermost, merging
    dims where the operands allow): a channels-last SE product with its [N, C, 1, 1] gate, a
    transposed output, size-1 dims and an operand broadcast along several dims."""
    g = torch.Generator().manual_seed(5)
    shape = (2, 24, 5, 7)
    x = torch.randn(shape, generator=g)
    gate = torch.rand(2, 24, 1, 1, generator=g)
    base = torch.empty([shape[p] for p in perm])
    out = base.permute([perm.index(d) for d in range(4)])  # y of `shape`, laid out by perm
    assert out.shape == shape
    native.pointwise("Mul", x.contiguous(memory_format=torch.channels_last), gate, out=out)
    _close(out, x.double() * gate.double())
    one = torch.randn(1, 24, 1, 7, generator=g)
    row = torch.randn(7, generator=g)
    _close(native.pointwise("Add", one, row), one.double() + row.double())


@needs_native
@pytest.mark.parametrize("c", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("op", ["Copy", "Relu"])
def test_short_channels_to_channels_last(op, c):
    """An NCHW image written channels-last (a network's input before its NHWC stem): with
    fewer than 8 channels the kernel walks rows along the image's contiguous dim (pointwise.c);
    at 8 it keeps y's order. Either way every element lands where torch puts it."""
    x = torch.randn(2, c, 23, 37, generator=torch.Generator().manual_seed(7))
    out = torch.empty(2, 23, 37, c).permute(0, 3, 1, 2)
    native.pointwise(op, x, out=out)
    want = x.double() if op == "Copy" else torch.relu(x.double())
    _close(out, want)
    assert torch.equal(out.permute(0, 2, 3, 1).contiguous(),
                       want.float().permute(0, 2, 3, 1).contiguous())


@needs_native
@pytest.mark.parametrize("n, c, h, w", [(1, 3, 224, 224), (2, 3, 23, 37), (1, 3, 5, 3),
                                        (1, 16, 17, 19), (3, 21, 9, 70), (1, 64, 8, 8),
                                        (1, 130, 3, 67), (1, 9, 1, 1)])
@pytest.mark.parametrize("direction", ["to_nhwc", "to_nchw"])
def test_transposing_copy_is_exact(n, c, h, w, direction):
    """A Copy that transposes the two innermost dims (NCHW -> NHWC of a model's input, or back)
    goes by tiles of 8 x 8 register transposes and, for 3 channels, vector interleaves
    (pointwise.c's transpose_copy): shapes on and off the 8- and 64-element edges, batches,
    both directions, each element exactly where torch puts it."""
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(c * h + w))
    if direction == "to_nhwc":
        out = torch.empty(n, h, w, c).permute(0, 3, 1, 2)
        src = x
    else:
        src = x.contiguous(memory_format=torch.channels_last)
        out = torch.empty(n, c, h, w)
    native.pointwise("Copy", src, out=out)
    assert torch.equal(out, x)


@needs_native
def test_transposing_copy_into_a_slice():
    """The transposed rows written with a row stride wider than the row (a channels-last
    buffer of 8 channels, the copy filling channels 2..5): the other channels stay."""
    x = torch.randn(1, 3, 12, 20, generator=torch.Generator().manual_seed(2))
    buf = torch.full((1, 12, 20, 8), 7.0)
    out = buf.permute(0, 3, 1, 2)[:, 2:5]
    native.pointwise("Copy", x, out=out)
    assert torch.equal(buf[..., 2:5].permute(0, 3, 1, 2), x)
    assert bool((buf[..., :2] == 7).all()) and bool((buf[..., 5:] == 7).all())


@needs_native
def test_no_reorder_short_inner_without_unit_stride_operand():
    """The short-inner reordering needs a unit-stride dim in the operand: a strided view of one
    (every other column) and a binary op keep the plain walk, and still match torch."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 3, 16, 40, generator=g)[..., ::2]
    out = torch.empty(1, 16, 20, 3).permute(0, 3, 1, 2)
    native.pointwise("Copy", x, out=out)
    _close(out, x.double())
    b = torch.randn(1, 3, 1, 1, generator=g)
    out2 = torch.empty(1, 16, 20, 3).permute(0, 3, 1, 2)
    native.pointwise("Add", x.contiguous(), b, out=out2)
    _close(out2, x.double() + b.double())


@needs_native
def test_pointwise_large_runs_threaded():
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(3))
    _close(native.pointwise("Sigmoid", x), torch.sigmoid(x.double()))


@needs_native
def test_pointwise_rejects_bad_operands():
    with pytest.raises(ValueError, match="pointwise Add"):
        native.pointwise("Add", torch.zeros(3), None)  # binary op, one operand
    with pytest.raises(ValueError, match="pointwise Relu"):
        native.pointwise("Relu", torch.zeros(3, dtype=torch.float64))


POOL_CASES = [  # kind, N, C, H, W, kernel, stride, dilation, pads (top, left)
    ("max", 1, 16, 9, 9, (3, 3), (2, 2), (1, 1), (1, 1)),
    ("max", 2, 5, 8, 7, (2, 2), (2, 2), (1, 1), (0, 0)),
    ("max", 1, 8, 9, 9, (3, 3), (1, 1), (2, 2), (1, 1)),
    ("avg_pad", 1, 12, 7, 7, (3, 3), (1, 1), (1, 1), (1, 1)),
    ("avg", 1, 12, 7, 7, (3, 3), (2, 2), (1, 1), (1, 1)),
    ("avg", 2, 300, 5, 6, (5, 6), (1, 1), (1, 1), (0, 0)),  # global, more than 256 channels
]


def _pool_reference(kind, x, k, s, d, p):
    xd = x.double()
    if kind == "max":
        return F.max_pool2d(xd, k, s, p, d)
    return F.avg_pool2d(xd, k, s, p, count_include_pad=kind == "avg_pad")


@needs_native
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: "-".join(map(str, c[:5])))
def test_pool_matches_torch(case, layout):
    kind, n, c, h, w, k, s, d, p = case
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(4))
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    want = _pool_reference(kind, x, k, s, d, p)
    got = native.pool2d(kind, x, k, s, d, p, tuple(want.shape[2:]))
    _close(got, want)
    if got.shape[2] * got.shape[3] > 1:  # (a 1x1 output is both)
        assert got.is_contiguous(memory_format=torch.channels_last) == (layout == "nhwc")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["nchw", "strided", "channels_last"])
def test_fused_conv_nhwc_view(dtype, layout):
    """FusedConv's NHWC view of its input: kiln's transposing copy for float32 (torch's
    otherwise), the same values and a contiguous NHWC layout either way; a channels-last input
    is viewed, not copied."""
    from kiln.kernels.torch.fused_conv import nhwc

    x = torch.randn(2, 3, 9, 14, generator=torch.Generator().manual_seed(1)).to(dtype)
    if layout == "strided":
        x = torch.randn(2, 3, 9, 28, dtype=dtype)[..., ::2]
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    v = nhwc(x)
    assert v.shape == (2, 9, x.shape[3], 3) and v.is_contiguous() and v.dtype == dtype
    assert torch.equal(v, x.permute(0, 2, 3, 1))
    if layout == "channels_last":
        assert v.data_ptr() == x.data_ptr()
