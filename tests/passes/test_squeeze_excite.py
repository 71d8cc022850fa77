"""fuse_squeeze_excite on real torch exports: MobileNetV3's block (ReduceMean -> Conv -> Relu ->
Conv -> HardSigmoid -> Mul) and EfficientNet's (SiLU and Sigmoid), tested for structure, counts
and numerics, and where it must not fire."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ops import fused_conv as FC
from kiln.passes.fusion.squeeze_excite import fuse_squeeze_excite
from tests.passes.exports import export_module, ort_run
from tests.passes.transformer_util import apply, feeds, run


def _se(act: str, gate: str, pool: str = "mean", gate_out: bool = False):
    import torch
    from torch import nn
    from torch.nn import functional as F

    acts = {"relu": F.relu, "silu": F.silu, "hardswish": F.hardswish, "relu6": F.relu6}
    gates = {"hardsigmoid": F.hardsigmoid, "sigmoid": torch.sigmoid}

    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.reduce, self.expand = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)

        def forward(self, x):
            s = x.mean((2, 3), keepdim=True) if pool == "mean" else F.adaptive_avg_pool2d(x, 1)
            g = gates[gate](self.expand(acts[act](self.reduce(s))))
            return (x * g, g) if gate_out else x * g

    return SE().eval()


@pytest.mark.parametrize("act,gate,pool,want", [
    ("relu", "hardsigmoid", "mean", ("Relu", "HardSigmoid")),      # MobileNetV3
    ("silu", "sigmoid", "gap", ("Silu", "Sigmoid")),               # EfficientNet
    ("hardswish", "sigmoid", "mean", ("HardSwish", "Sigmoid")),
])
def test_squeeze_excite_structure_counts_numerics(act, gate, pool, want):
    m = export_module(_se(act, gate, pool), (1, 8, 5, 6))
    f = feeds(x=(2, 8, 5, 6))
    g, before, after, n, logs = apply(m, fuse_squeeze_excite, f)
    assert n == 1 and before["Conv"] == 2 and after == {"SqueezeExcite": 1}
    (se,) = g.nodes
    assert se.op is FC.SqueezeExcite and (se.attrs.activation, se.attrs.gate) == want
    if gate == "hardsigmoid":  # torch's hardsigmoid: relu6(x + 3) / 6
        assert abs(se.attrs.alpha - 1 / 6) < 1e-6 and se.attrs.beta == 0.5
    x, w1, b1, w2, b2 = se.inputs
    assert x is g.inputs[0] and w1.const.shape == (2, 8, 1, 1) and w2.const.shape == (8, 2, 1, 1)
    assert b1.const.shape == (2,) and b2.const.shape == (8,)
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-5, atol=1e-6)


def test_no_fuse_squeeze_excite_gate_is_an_output():
    m = export_module(_se("relu", "hardsigmoid", gate_out=True), (1, 8, 5, 6))
    _, before, after, n, logs = apply(m, fuse_squeeze_excite, feeds(x=(2, 8, 5, 6)))
    assert n == 0 and after == before
    assert not any("squeeze-excite" in m for m in logs)  # an output gate is no candidate


def test_no_fuse_squeeze_excite_clip_activation():
    # relu6 between the convs is a Clip with bounds: not an activation SqueezeExcite takes
    m = export_module(_se("relu6", "sigmoid"), (1, 8, 5, 6))
    _, before, after, n, logs = apply(m, fuse_squeeze_excite, feeds(x=(2, 8, 5, 6)))
    assert n == 0 and after == before
    near = [m for m in logs if m.startswith("not fused: squeeze-excite")]
    assert len(near) == 1 and "activation between the two convs" in near[0]
