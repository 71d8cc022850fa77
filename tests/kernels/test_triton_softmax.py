import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.triton import softmax
from kiln.ops import nn as N
from tests.kernels.triton_util import assert_close, call, gpu, randn

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASES = [((3, 4, 10), None), ((2, 3, 70), {"BLOCK": 16, "num_warps": 1})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tactic", CASES)
@pytest.mark.parametrize("log", [False, True])
def test_triton_softmax_matches_torch(dtype, shape, tactic, log):
    x = randn(*shape, dtype=dtype) * 4
    op, fn = (N.LogSoftmax, softmax.log_softmax) if log else (N.Softmax, softmax.softmax)
    y = fn(call(op, tactic), x)
    want = torch.log_softmax(x.float(), -1) if log else torch.softmax(x.float(), -1)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, want, scale=4 if log else 1)


def test_triton_softmax_masked_row_with_minus_inf():
    x = randn(2, 40)
    x[:, 5:] = float("-inf")  # only 5 live columns, the looped path sees all--inf chunks
    y = softmax.softmax(call(N.Softmax, {"BLOCK": 16, "num_warps": 1}), x)
    assert_close(y, torch.softmax(x, -1))


def test_triton_softmax_other_axis_falls_back():
    x = randn(3, 5, 4)
    n = call(N.Softmax, axis=1)
    assert not softmax.supports(n, (x,))
    assert_close(softmax.softmax(n, x), torch.softmax(x, 1))


@gpu
@pytest.mark.gpu
def test_triton_softmax_gpu_attention_scores():
    x = randn(64, 12, 128, 128, dtype=torch.float16, device="cuda")
    n = call(N.Softmax)
    for t in [None, *softmax.tactics(n, (x,))]:
        n.tactic = t
        assert_close(softmax.softmax(n, x), torch.softmax(x.float(), -1))
