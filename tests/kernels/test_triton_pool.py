import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.registry import kernels_for
from kiln.kernels.triton import pool
from kiln.ops import nn as N
from tests.kernels.triton_util import DEVICE, call, randn

# (x shape NCHW, attrs): ResNet's stem pool, ceil mode, asymmetric pads, dilation, 2x2 s2,
# channels beyond one block and a tactic with a short pixel tile
CASES = [
    ((2, 8, 9, 9), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), None),
    ((1, 5, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), None),
    ((1, 3, 6, 6), dict(kernel_shape=[2, 3], strides=[1, 2], pads=[0, 1, 1, 0]), None),
    ((1, 4, 9, 9), dict(kernel_shape=[3, 3], dilations=[2, 2]), None),
    ((2, 70, 4, 6), dict(kernel_shape=[2, 2], strides=[2, 2]),
     {"BLOCK_P": 16, "BLOCK_C": 64, "num_warps": 4}),
]


def _nhwc(x):
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("shape,attrs,tactic", CASES)
def test_triton_maxpool_matches_the_torch_kernel(dtype, shape, attrs, tactic):
    from kiln.kernels.torch import nn as torch_nn

    x = _nhwc(randn(*shape, dtype=dtype))
    n = call(N.MaxPool, tactic, **attrs)
    assert pool.supports(n, (x,))
    want = torch_nn.max_pool(n, x.float())
    got = pool.max_pool(n, x)
    assert got.dtype == dtype and got.shape == want.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    # a max picks one input element: exact in any dtype
    torch.testing.assert_close(got.float().cpu(), want.to(dtype).float().cpu(), atol=0, rtol=0)


def test_triton_maxpool_padding_never_wins_over_negative_inputs():
    """All-negative inputs with padding: padded taps are -inf, not 0 (a zero-padded max would
    return 0 at the border)."""
    x = _nhwc(-1.0 - torch.rand(1, 4, 5, 5).to(DEVICE))
    n = call(N.MaxPool, None, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    got = pool.max_pool(n, x)
    want = F.max_pool2d(x.cpu(), 3, 1, 1)
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)
    assert (got < 0).all()


def test_no_triton_maxpool_for_indices_nchw_or_integers():
    """Indices (two outputs), an NCHW-contiguous input and integer inputs run the PyTorch
    kernel (``supports`` says no, and the kernel falls back to the same result)."""
    x = randn(1, 3, 6, 6)
    attrs = dict(kernel_shape=[2, 2], strides=[2, 2])
    assert not pool.supports(call(N.MaxPool, None, n_out=2, **attrs), (_nhwc(x),))
    assert not pool.supports(call(N.MaxPool, None, **attrs), (x,))  # NCHW memory
    xi = _nhwc(torch.randint(-5, 5, (1, 3, 6, 6), dtype=torch.int32).to(DEVICE))
    assert not pool.supports(call(N.MaxPool, None, **attrs), (xi,))
    got = pool.max_pool(call(N.MaxPool, None, **attrs), x)
    torch.testing.assert_close(got.cpu(), F.max_pool2d(x.cpu(), 2, 2))


def test_triton_maxpool_is_registered_for_the_cuda_backend():
    assert "TritonMaxPool" in [k.name for k in kernels_for(N.MaxPool, "cuda")]
