"""fold_conv_bn: Conv + inference BatchNormalization -> one Conv with folded weight and bias."""

from __future__ import annotations

import numpy as np

from kiln.ops import nn as N
from kiln.passes.fusion.conv_bn import fold_conv_bn
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node

C_IN, C_OUT = 3, 4


def _bn_inits() -> dict:
    return {"gamma": c(RNG.uniform(0.5, 1.5, C_OUT)), "beta": c(RNG.standard_normal(C_OUT)),
            "mean": c(RNG.standard_normal(C_OUT)), "var": c(RNG.uniform(0.5, 2.0, C_OUT))}


def _conv_bn(bias: bool = True, outputs=("y",), scale_input: bool = False):
    inits = {"W": c(RNG.standard_normal((C_OUT, C_IN, 3, 3))), **_bn_inits()}
    conv_ins = ["x", "W"]
    if bias:
        inits["B"] = c(RNG.standard_normal(C_OUT))
        conv_ins.append("B")
    inputs = {"x": [2, C_IN, 8, 8]}
    if scale_input:  # the BN scale arrives at run time: not foldable
        del inits["gamma"]
        inputs["gamma"] = [C_OUT]
    nodes = [node("Conv", conv_ins, "t", name="conv", pads=[1, 1, 1, 1]),
             node("BatchNormalization", ["t", "gamma", "beta", "mean", "var"], "y", name="bn",
                  epsilon=1e-3)]
    return model(nodes, inputs, list(outputs), inits)


def test_fold_conv_bn_structure():
    g, _, _, n, logs = apply(_conv_bn(), fold_conv_bn, feeds(x=[2, C_IN, 8, 8]), atol=1e-4)
    assert n == 1 and logs == ["fused conv + bn -> Conv"]
    (conv,) = g.nodes
    assert conv.op is N.Conv and conv.name == "conv + bn"
    assert conv.inputs[0] is g.inputs[0] and conv.outputs[0] is g.outputs[0]
    assert conv.inputs[1].const is not None and conv.inputs[2].const.shape == (C_OUT,)
    assert "W" not in g.weights and "gamma" not in g.weights  # folded away


def test_fold_conv_bn_counts():
    _, before, after, _, _ = apply(_conv_bn(), fold_conv_bn, feeds(x=[2, C_IN, 8, 8]), atol=1e-4)
    assert before == {"BatchNormalization": 1, "Conv": 1} and after == {"Conv": 1}


def test_fold_conv_bn_numerics_without_conv_bias():
    # apply() checks outputs before == after
    g, _, after, _, _ = apply(_conv_bn(bias=False), fold_conv_bn, feeds(x=[2, C_IN, 8, 8]),
                              atol=1e-4)
    assert after == {"Conv": 1} and len(g.nodes[0].inputs) == 3


def test_fold_conv_bn_weights_are_exact():
    m = _conv_bn()
    g, _, _, _, _ = apply(m, fold_conv_bn, feeds(x=[2, C_IN, 8, 8]), atol=1e-4)
    init = {t.name: np.frombuffer(t.raw_data, np.float32) for t in m.graph.initializer}
    s = init["gamma"].astype(np.float64) / np.sqrt(init["var"] + 1e-3)
    want_b = (init["B"] - init["mean"]) * s + init["beta"]
    np.testing.assert_allclose(g.nodes[0].inputs[2].const, want_b, rtol=1e-6)


def test_no_fuse_conv_bn_conv_output_is_graph_output():
    _, before, after, n, _ = apply(_conv_bn(outputs=("y", "t")), fold_conv_bn,
                                   feeds(x=[2, C_IN, 8, 8]))
    assert n == 0 and before == after


def test_no_fuse_conv_bn_scale_not_constant():
    f = feeds(x=[2, C_IN, 8, 8], gamma=[C_OUT])
    _, before, after, n, _ = apply(_conv_bn(scale_input=True), fold_conv_bn, f)
    assert n == 0 and before == after
