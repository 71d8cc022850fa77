import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.registry import Call, kernels_for
from kiln.kernels.triton import squeeze_excite as SE
from kiln.ops import fused_conv as FC
from tests.kernels.triton_util import assert_close, randn

ACTS = {"": lambda t: t, "Relu": torch.relu, "HardSwish": F.hardswish, "Silu": F.silu}


def _call(activation="Relu", gate="Sigmoid", alpha=0.0, beta=0.0):
    return Call(FC.SqueezeExcite.make_attrs(activation=activation, gate=gate, alpha=alpha,
                                            beta=beta), n_out=1, n_in=5)


def _ref(x, w1, b1, w2, b2, activation, gate, alpha, beta):
    """The block written out in float32: mean, two 1x1 convs as products, the gate, the scale."""
    s = x.float().mean((2, 3))
    h = s @ w1.float().flatten(1).t() + (0 if b1 is None else b1.float())
    h = ACTS[activation](h)
    g = h @ w2.float().flatten(1).t() + (0 if b2 is None else b2.float())
    g = (alpha * g + beta).clamp(0, 1) if gate == "HardSigmoid" else torch.sigmoid(g)
    return x.float() * g[:, :, None, None]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("layout", ("nchw", "nhwc"))
@pytest.mark.parametrize("shape,cr,activation,gate,biases", [
    ((2, 72, 7, 9), 24, "Relu", "HardSigmoid", True),   # MobileNetV3's form; HW off the tile
    ((1, 16, 5, 5), 8, "Silu", "Sigmoid", True),         # EfficientNet's form
    ((3, 130, 4, 3), 20, "HardSwish", "Sigmoid", False),  # C past two blocks, no biases
    ((1, 40, 1, 1), 40, "", "HardSigmoid", True),         # a 1x1 map, Cr == C
])
def test_triton_squeeze_excite_matches_the_block(dtype, layout, shape, cr, activation, gate,
                                                 biases):
    nb, c, h, w = shape
    x = randn(*shape, dtype=dtype)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    w1, w2 = randn(cr, c, 1, 1, dtype=dtype) * 0.3, randn(c, cr, 1, 1, dtype=dtype) * 0.3
    b1, b2 = (randn(cr, dtype=dtype), randn(c, dtype=dtype)) if biases else (None, None)
    alpha, beta = (1 / 6, 0.5) if gate == "HardSigmoid" else (0.0, 0.0)
    n = _call(activation, gate, alpha, beta)
    assert SE.supports(n, (x, w1, b1, w2, b2))
    y = SE.squeeze_excite(n, x, w1, b1, w2, b2)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    assert_close(y, _ref(x, w1, b1, w2, b2, activation, gate, alpha, beta), scale=2)


def test_no_triton_squeeze_excite_for_odd_inputs():
    """A 3-D input, a hidden width past what the MLP keeps in registers, a bias of the wrong
    size, or a gate it does not know run the PyTorch kernel (same result)."""
    x = randn(1, 8, 4, 4)
    w1, w2 = randn(4, 8, 1, 1), randn(8, 4, 1, 1)
    n = _call()
    assert not SE.supports(n, (x[0], w1, None, w2, None))
    assert not SE.supports(n, (x, w1, randn(5), w2, None))
    assert not SE.supports(_call(gate="Tanh"), (x, w1, None, w2, None))
    big = SE._MAX_HIDDEN + 1
    assert not SE.supports(n, (randn(1, 4, 2, 2), randn(big, 4, 1, 1), None,
                               randn(4, big, 1, 1), None))
    got = SE.squeeze_excite(n, x[0:1].contiguous().squeeze(0).unsqueeze(0), w1, None, w2,
                            None)  # a supported call still matches after the refusals
    assert_close(got, _ref(x, w1, None, w2, None, "Relu", "Sigmoid", 0.0, 0.0))


def test_triton_squeeze_excite_is_registered_for_cuda():
    assert "TritonSqueezeExcite" in [k.name for k in kernels_for(FC.SqueezeExcite, "cuda")]
