"""fold_conv_add: Conv + Add/Sub of a per-channel constant -> one Conv with that bias (Paddle's
exports write a conv's bias so), structure, counts and numerics, where it must not fire, and
the squeeze-excite block it lets fuse."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ops import fused_conv as FC
from kiln.ops import nn as N
from kiln.passes.fusion.conv_bias import fold_conv_add
from kiln.passes.pipeline import optimize
from tests.passes.exports import ort_run
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node, run

C_IN, C_OUT = 3, 4
X = [2, C_IN, 6, 7]


def _typed(m):
    """Float outputs (onnxruntime refuses the helper's untyped ones)."""
    for o in m.graph.output:
        o.type.tensor_type.elem_type = 1
    return m


def _conv_add(op="Add", shape=(1, C_OUT, 1, 1), bias=False, conv_first=True, outputs=("y",)):
    inits = {"W": c(RNG.standard_normal((C_OUT, C_IN, 3, 3))),
             "k": c(RNG.standard_normal(shape))}
    conv_ins = ["x", "W"]
    if bias:
        inits["B"] = c(RNG.standard_normal(C_OUT))
        conv_ins.append("B")
    ins = ["t", "k"] if conv_first else ["k", "t"]
    nodes = [node("Conv", conv_ins, "t", name="conv", pads=[1, 1, 1, 1]),
             node(op, ins, "y", name="add")]
    return _typed(model(nodes, {"x": X}, list(outputs), inits)), inits


@pytest.mark.parametrize("op,shape,bias,conv_first", [
    ("Add", (1, C_OUT, 1, 1), False, True),   # Paddle's bias
    ("Add", (C_OUT, 1, 1), True, False),      # onto a bias, constant first
    ("Sub", (1, C_OUT, 1, 1), True, True),
    ("Add", (1,), False, True),               # one value for every channel
])
def test_fold_conv_add_structure_counts_numerics(op, shape, bias, conv_first):
    m, inits = _conv_add(op, shape, bias, conv_first)
    f = feeds(x=X)
    g, before, after, n, logs = apply(m, fold_conv_add, f, atol=1e-5)
    assert n == 1 and logs == ["fused conv + add -> Conv"]
    assert before == {"Conv": 1, op: 1} and after == {"Conv": 1}
    (conv,) = g.nodes
    assert conv.op is N.Conv and conv.inputs[0] is g.inputs[0] and conv.outputs[0] is g.outputs[0]
    k = np.broadcast_to(inits["k"].reshape(-1), (C_OUT,))
    want = (inits["B"] if bias else 0) + (-k if op == "Sub" else k)
    np.testing.assert_allclose(conv.inputs[2].const, want, rtol=1e-6)
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["spatial", "constant_minus_conv", "read_twice"])
def test_no_fuse_conv_add(case):
    if case == "spatial":  # a constant that varies over H and W is no bias
        m, _ = _conv_add(shape=(1, C_OUT, 6, 7))
    elif case == "constant_minus_conv":  # c - conv: the conv's sign flips
        m, _ = _conv_add("Sub", conv_first=False)
    else:  # the conv's own output is read too
        m, _ = _conv_add(outputs=("y", "t"))
    _, before, after, n, _ = apply(m, fold_conv_add, feeds(x=X))
    assert n == 0 and after == before


def test_conv_add_lets_paddle_squeeze_excite_fuse():
    """Paddle's SE block: GlobalAveragePool -> Conv -> Add(b1) -> Relu -> Conv -> Add(b2) ->
    HardSigmoid -> Mul: one SqueezeExcite after the pipeline."""
    ch, mid = 8, 2
    inits = {"w1": c(RNG.standard_normal((mid, ch, 1, 1))), "b1": c(RNG.standard_normal(
        (1, mid, 1, 1))), "w2": c(RNG.standard_normal((ch, mid, 1, 1))),
        "b2": c(RNG.standard_normal((1, ch, 1, 1)))}
    nodes = [node("GlobalAveragePool", ["x"], "s"), node("Conv", ["s", "w1"], "c1"),
             node("Add", ["c1", "b1"], "a1"), node("Relu", ["a1"], "r"),
             node("Conv", ["r", "w2"], "c2"), node("Add", ["c2", "b2"], "a2"),
             node("HardSigmoid", ["a2"], "g", alpha=0.2, beta=0.5), node("Mul", ["x", "g"], "y")]
    m = _typed(model(nodes, {"x": [1, ch, 5, 5]}, ["y"], inits, opset=13))
    from kiln.frontend import import_onnx

    g = optimize(import_onnx(m))
    assert [n.op for n in g.nodes] == [FC.SqueezeExcite]
    f = feeds(x=[1, ch, 5, 5])
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-5, atol=1e-6)
