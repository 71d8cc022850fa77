"""GELU, Mish and HardSwish as torch.onnx and transformers' activation modules export them, at
several opsets -> one Gelu / Mish / HardSwish node (structure, counts, numerics), and where the
fusions must not fire."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ops import math as M
from kiln.passes.fusion.activation import fuse_activations, fuse_hard_sixths
from kiln.passes.fusion.gelu import fuse_gelu
from tests.passes.exports import export_module, ort_run
from tests.passes.transformer_util import apply, feeds, run


def _act(name):
    import torch
    from torch import nn

    if name in ("gelu_new", "gelu_fast"):
        pytest.importorskip("transformers")
        from transformers.activations import FastGELUActivation, NewGELUActivation
        return NewGELUActivation() if name == "gelu_new" else FastGELUActivation()
    return {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "mish": nn.Mish(),
            "hardswish": nn.Hardswish(),
            # GPT-2's tanh GELU with a wrong constant: close, and must not become a Gelu
            "gelu_off": lambda x: 0.5 * x * (1 + torch.tanh(0.79788456 * (
                x + 0.04 * torch.pow(x, 3))))}[name]


def _net(name):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = torch.nn.Linear(8, 8), _act(name)

        def forward(self, x):
            return self.act(self.lin(x))
    return Net().eval()


CASES = [  # activation, opset, pass, fused op, attribute checks, nodes the export writes
    ("gelu", 17, fuse_gelu, M.Gelu, {"approximate": "none"}, {"Erf": 1, "Div": 1}),
    ("gelu_tanh", 17, fuse_gelu, M.Gelu, {"approximate": "tanh"}, {"Tanh": 1}),
    ("gelu_new", 17, fuse_gelu, M.Gelu, {"approximate": "tanh"}, {"Pow": 1, "Tanh": 1}),
    ("gelu_fast", 17, fuse_gelu, M.Gelu, {"approximate": "tanh"}, {"Tanh": 1}),
    ("gelu_new", 11, fuse_gelu, M.Gelu, {"approximate": "tanh"}, {"Pow": 1}),
    ("mish", 17, fuse_activations, M.Mish, {}, {"Softplus": 1, "Tanh": 1}),
    ("hardswish", 11, fuse_activations, M.HardSwish, {}, {"HardSigmoid": 1}),
]


@pytest.mark.parametrize("name,opset,fn,op,attrs,written", CASES,
                         ids=[f"{c[0]}-op{c[1]}" for c in CASES])
def test_exported_activation_structure_counts_numerics(name, opset, fn, op, attrs, written):
    m = export_module(_net(name), (2, 5, 8), opset)
    f = feeds(x=(3, 5, 8))
    g, before, after, n, logs = apply(m, fn, f, rtol=1e-5, atol=1e-5)
    assert n == 1 and all(before.get(k, 0) >= v for k, v in written.items())
    fused = [x for x in g.nodes if x.op is op]
    assert len(fused) == 1 and after[op.name] == 1
    for k, v in attrs.items():
        assert getattr(fused[0].attrs, k) == v
    # the activation reads the Linear's output and is the graph's output
    assert fused[0].inputs[0].producer.op.name == "Add" and fused[0].outputs[0] is g.outputs[0]
    # nothing of the spelled-out form is left (its Constant nodes go at dead-code removal)
    assert set(after) - {"Constant"} == {"MatMul", "Add", op.name}, after
    np.testing.assert_allclose(_run(g, f), ort_run(m, f)[0], rtol=1e-4, atol=1e-5)


def _run(g, f):
    return run(g, f)[0]


def test_no_fuse_gelu_wrong_constant():
    m = export_module(_net("gelu_off"), (2, 5, 8))
    _, before, after, n, _ = apply(m, fuse_gelu, feeds(x=(3, 5, 8)))
    assert n == 0 and after == before and after["Tanh"] == 1


def test_no_fuse_mish_gate_read_twice():
    import torch
    from torch.nn import functional as F

    class Net(torch.nn.Module):
        def forward(self, x):
            gate = torch.tanh(F.softplus(x))
            return x * gate + gate  # the gate is read outside the Mish

    m = export_module(Net(), (2, 8))
    _, before, after, n, _ = apply(m, fuse_activations, feeds(x=(3, 8)))
    assert n == 0 and after == before and "Mish" not in after


def _both(g, log):  # the activation module's passes, in the pipeline's order
    return fuse_hard_sixths(g, log) + fuse_activations(g, log)


SIXTHS = {  # x * relu6(x + 3) / 6 and relu6(x + 3) / 6 written out (Paddle writes the first)
    "hardswish_div": (lambda x, F: x * F.relu6(x + 3) / 6, M.HardSwish, 1),
    "hardswish_mul": (lambda x, F: x * F.relu6(3 + x) * (1 / 6), M.HardSwish, 1),
    "hardsigmoid_div": (lambda x, F: F.relu6(x + 3) / 6, M.HardSigmoid, 1),
    # the gate then the product: HardSigmoid first, HardSwish from it
    "hardswish_gate": (lambda x, F: x * (F.relu6(x + 3) / 6), M.HardSwish, 2),
}


def _sixth_net(fn):
    import torch
    from torch.nn import functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return fn(self.lin(x), F)
    return Net().eval()


@pytest.mark.parametrize("name", sorted(SIXTHS))
def test_hard_sixths_structure_counts_numerics(name):
    fn, op, rewrites = SIXTHS[name]
    m = export_module(_sixth_net(fn), (2, 5, 8), 13)
    f = feeds(x=(3, 5, 8))
    g, before, after, n, _ = apply(m, _both, f, rtol=1e-5, atol=1e-5)
    assert n == rewrites and before["Clip"] == 1
    assert set(after) - {"Constant"} == {"MatMul", "Add", op.name}, after
    assert after["Add"] == 1  # the Linear's bias alone: x + 3 is gone
    (fused,) = [x for x in g.nodes if x.op is op]
    assert fused.inputs[0].producer.op.name == "Add" and fused.outputs[0] is g.outputs[0]
    if op is M.HardSigmoid:
        assert abs(fused.attrs.alpha - 1 / 6) < 1e-7 and fused.attrs.beta == 0.5
    np.testing.assert_allclose(_run(g, f), ort_run(m, f)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [
    lambda x, F: x * F.relu6(x + 3) / 5,          # not a sixth
    lambda x, F: x * F.relu6(x + 2) / 6,          # not shifted by 3
    lambda x, F: x * torch_clamp(x + 3, 0, 5) / 6,  # not relu6
    lambda x, F: F.relu6(x + 3) / 6 + F.relu6(x + 3),  # relu6(x + 3) read twice
], ids=["div5", "plus2", "clip5", "read_twice"])
def test_no_fuse_hard_sixths(fn):
    m = export_module(_sixth_net(fn), (2, 5, 8), 13)
    _, before, after, n, _ = apply(m, _both, feeds(x=(3, 5, 8)))
    assert n == 0 and after == before


def torch_clamp(x, lo, hi):
    return x.clamp(lo, hi)
