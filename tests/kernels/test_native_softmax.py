"""kiln.native's last-axis softmax (kiln/native/softmax.c) against torch in float64: short and
long rows (tails of 1-7 floats), row strides, NaN and -inf rows, the thread split; the Softmax
kernel takes it for large float32 last-axis softmaxes and leaves the rest to torch."""

from __future__ import annotations

import pytest
import torch

from kiln import native

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")


@needs_native
@pytest.mark.parametrize("shape", [(3234, 21), (1, 3234, 91), (5, 8), (7, 1), (3, 17, 33),
                                   (2, 4000)], ids=str)
def test_softmax_rows_matches_torch(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4
    got = native.softmax_rows(x)
    want = torch.softmax(x.double(), -1)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-7)
    assert got.is_contiguous() and got.shape == x.shape


@needs_native
def test_softmax_rows_strided_rows_nan_and_infinities():
    base = torch.randn(40, 30)
    x = base[:, 3:24]  # rows of 21 with a row stride of 30
    torch.testing.assert_close(native.softmax_rows(x).double(), torch.softmax(x.double(), -1),
                               rtol=2e-6, atol=1e-7)
    y = torch.randn(4, 11)
    y[1, 5] = float("nan")
    y[2] = float("-inf")
    y[3, 2] = float("-inf")
    got, want = native.softmax_rows(y), torch.softmax(y, -1)
    assert torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    assert torch.isnan(got[2]).all() and torch.isnan(want[2]).all()
    assert got[3, 2] == 0
    torch.testing.assert_close(got[[0, 3]], want[[0, 3]], rtol=2e-6, atol=1e-7)


@needs_native
def test_softmax_rows_thread_split_changes_nothing():
    x = torch.randn(3234, 21)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.softmax_rows(x)
        torch.set_num_threads(2)
        two = native.softmax_rows(x)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@needs_native
def test_softmax_kernel_takes_native_where_it_fits(monkeypatch):
    """Large float32 last-axis softmaxes with evenly strided rows run softmax.c; small ones,
    other axes, float64, a transposed view and unevenly strided leading dims run torch's
    (must not fire)."""
    from kiln.kernels.registry import Call
    from kiln.kernels.torch import nn_norm as K
    from kiln.ops import nn as N

    calls = []
    real = native.softmax_rows
    monkeypatch.setattr(native, "softmax_rows", lambda x: calls.append(x.shape) or real(x))

    def run(x, axis=-1):
        got = K.softmax(Call(N.Softmax.make_attrs(axis=axis), 1, 13), x)
        torch.testing.assert_close(got, torch.softmax(x, axis), rtol=2e-6, atol=1e-7)

    run(torch.randn(1, 3234, 21))
    run(torch.randn(2, 64, 96)[:, :, :80])  # row stride 96
    assert calls == [(1, 3234, 21), (2, 64, 80)]
    run(torch.randn(4, 20))  # small
    run(torch.randn(1, 3234, 21), axis=1)
    run(torch.randn(1, 3234, 21).double())
    run(torch.randn(1, 21, 3234).transpose(1, 2))
    run(torch.randn(4, 64, 64)[::2])  # leading dim strided past its rows
    assert len(calls) == 2
