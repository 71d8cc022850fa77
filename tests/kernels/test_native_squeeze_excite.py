"""kiln::SqueezeExcite's CPU kernel on kiln's native kernels (pooling, two GEMMs, the gate, the
product) against the same block in torch float64, for both gates, channels-last and
contiguous inputs, a batch of 2; and the torch ops where a weight is not float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch.squeeze_excite import squeeze_excite
from kiln.ops import fused_conv as FC

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")


def _reference(x, w1, b1, w2, b2, act, gate, alpha, beta):
    s = x.double().mean((2, 3))
    h = F.linear(s, w1.double().flatten(1), b1.double())
    h = {"Relu": F.relu, "HardSwish": F.hardswish, "Silu": F.silu}[act](h)
    g = F.linear(h, w2.double().flatten(1), b2.double())
    g = torch.sigmoid(g) if gate == "Sigmoid" else (alpha * g + beta).clamp(0, 1)
    return x.double() * g[:, :, None, None]


@needs_native
@pytest.mark.parametrize("act,gate", [("Relu", "HardSigmoid"), ("Silu", "Sigmoid"),
                                      ("HardSwish", "Sigmoid")])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_squeeze_excite_native_matches_torch(act, gate, layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 7, 9, generator=g)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    w1, b1 = torch.randn(10, 40, 1, 1, generator=g) / 6, torch.randn(10, generator=g)
    w2, b2 = torch.randn(40, 10, 1, 1, generator=g) / 3, torch.randn(40, generator=g)
    alpha, beta = (1 / 6, 0.5) if gate == "HardSigmoid" else (0.0, 0.0)
    call = Call(FC.SqueezeExcite.make_attrs(activation=act, gate=gate, alpha=alpha, beta=beta),
                n_out=1, n_in=5)
    for _ in range(2):  # packs on the first run, reuses after
        y = squeeze_excite(call, x, w1, b1, w2, b2)
        want = _reference(x, w1, b1, w2, b2, act, gate, alpha, beta)
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert "se_native" in call.cache
    assert y.is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")


@needs_native
def test_squeeze_excite_float64_weights_stay_on_torch():
    x = torch.randn(1, 8, 3, 3, dtype=torch.float64)
    w1, w2 = torch.randn(2, 8, 1, 1, dtype=torch.float64), torch.randn(8, 2, 1, 1,
                                                                       dtype=torch.float64)
    call = Call(FC.SqueezeExcite.make_attrs(activation="Relu", gate="Sigmoid"), n_out=1, n_in=5)
    y = squeeze_excite(call, x, w1, None, w2, None)
    assert "se_native" not in call.cache and y.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_squeeze_excite_small_gemv_without_cublas(dtype, monkeypatch):
    """The GPU path's cuBLAS-free GEMV (broadcast product + sum) gives F.linear's values and
    never calls it; above the size limit a GPU tensor would take F.linear."""
    from kiln.kernels.torch import squeeze_excite as se

    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 40, generator=g).to(dtype)
    w, b = torch.randn(10, 40, generator=g).to(dtype), torch.randn(10, generator=g).to(dtype)
    want = torch.nn.functional.linear(s.float(), w.float(), b.float())
    monkeypatch.setattr(se.F, "linear", lambda *a: pytest.fail("called F.linear"))
    got = se._small_linear(s, w, b, small=True)
    assert got.shape == (3, 10) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=2e-2 if dtype == torch.float16 else 1e-5)
    assert se._small_linear(s, w, None, small=True).shape == (3, 10)
