"""fuse_conv_bias_act: Conv / Gemm / MatMul + bias + residual Add + activation -> one fused op."""

from __future__ import annotations

import pytest
from onnx import numpy_helper

from kiln.ops import fused_conv as FC
from kiln.passes.fusion.conv_bias_act import fuse_conv_bias_act
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node

X = [2, 4, 6, 6]
PAD = {"pads": [1, 1, 1, 1]}


def _w(*shape):
    return c(RNG.standard_normal(shape) * 0.3)


def _conv_model(tail, outputs=("y",), extra_inputs=None, bias=True, opset=17, w_input=False):
    """x -> Conv(W[, B]) -> t, then ``tail`` nodes reading t."""
    inits = {"W": _w(4, 4, 3, 3)}
    if bias:
        inits["B"] = _w(4)
    inputs = {"x": X, **(extra_inputs or {})}
    if w_input:
        inputs["W"] = [4, 4, 3, 3]
        del inits["W"]
    conv = node("Conv", ["x", "W"] + (["B"] if bias else []), "t", name="conv", **PAD)
    return model([conv, *tail], inputs, list(outputs), inits, opset=opset)


def test_fuse_conv_relu_structure():
    m = _conv_model([node("Relu", ["t"], "y", name="relu")])
    g, _, _, n, logs = apply(m, fuse_conv_bias_act, feeds(x=X))
    (f,) = g.nodes
    assert n == 1 and logs == ["fused conv + relu -> FusedConv"]
    assert f.op is FC.FusedConv and f.name == "conv + relu"
    assert f.attrs.activation == "Relu" and not f.attrs.has_residual
    assert f.attrs.pads == (1, 1, 1, 1) and [v.name for v in f.inputs] == ["x", "W", "B"]
    assert f.outputs[0] is g.outputs[0]


def test_fuse_conv_add_relu_residual_counts():
    tail = [node("Add", ["t", "r"], "s", name="add"), node("Relu", ["s"], "y", name="relu")]
    m = _conv_model(tail, extra_inputs={"r": X})
    g, before, after, _, _ = apply(m, fuse_conv_bias_act, feeds(x=X, r=X))
    assert before == {"Add": 1, "Conv": 1, "Relu": 1} and after == {"FusedConv": 1}
    (f,) = g.nodes
    assert f.name == "conv + add + relu" and f.attrs.has_residual == 1
    assert [v.name for v in f.inputs] == ["x", "W", "B", "r"]


def test_fuse_conv_const_bias_add():
    tail = [node("Add", ["t", "b"], "s", name="bias"), node("Relu", ["s"], "y", name="relu")]
    m = _conv_model(tail, bias=False)
    m.graph.initializer.append(numpy_helper.from_array(_w(1, 4, 1, 1), "b"))
    g, _, after, _, _ = apply(m, fuse_conv_bias_act, feeds(x=X))
    assert after == {"FusedConv": 1} and g.nodes[0].inputs[2].const.shape == (4,)
    assert "b" not in g.weights


ACTS = [
    ([node("Clip", ["t", "lo", "hi"], "y", name="act")], "Clip", {"lo": c(0.0), "hi": c(6.0)}),
    ([node("Sigmoid", ["t"], "y", name="act")], "Sigmoid", {}),
    ([node("Sigmoid", ["t"], "sg", name="sig"), node("Mul", ["t", "sg"], "y", name="act")],
     "Silu", {}),
    ([node("HardSwish", ["t"], "y", name="act")], "HardSwish", {}),
    ([node("LeakyRelu", ["t"], "y", name="act", alpha=0.2)], "LeakyRelu", {}),
    ([node("Tanh", ["t"], "y", name="act")], "Tanh", {}),
    ([node("Gelu", ["t"], "y", name="act")], "Gelu", {}),
    ([node("Gelu", ["t"], "y", name="act", approximate="tanh")], "GeluTanh", {}),
]


@pytest.mark.parametrize("tail,act,consts", ACTS, ids=[a[1] for a in ACTS])
def test_fuse_conv_activation(tail, act, consts):
    m = _conv_model(tail, opset=20)
    for k, v in consts.items():
        m.graph.initializer.append(numpy_helper.from_array(v, k))
    g, _, after, _, _ = apply(m, fuse_conv_bias_act, feeds(x=X))
    assert after == {"FusedConv": 1} and g.nodes[0].attrs.activation == act
    if act == "Clip":
        assert (g.nodes[0].attrs.alpha, g.nodes[0].attrs.beta) == (0.0, 6.0)


def test_fuse_gemm_relu():
    m = model([node("Gemm", ["x", "W", "B"], "t", name="fc", transB=1),
               node("Relu", ["t"], "y", name="relu")], {"x": [3, 5]}, ["y"],
              {"W": _w(4, 5), "B": _w(4)})
    g, _, after, _, _ = apply(m, fuse_conv_bias_act, feeds(x=[3, 5]))
    assert after == {"FusedGemm": 1} and g.nodes[0].attrs.transB == 1


def test_fuse_matmul_gelu_residual():
    m = model([node("MatMul", ["x", "W"], "t", name="mm"),
               node("Add", ["r", "t"], "s", name="add"),
               node("Gelu", ["s"], "y", name="gelu")], {"x": [2, 3, 5], "r": [2, 3, 4]}, ["y"],
              {"W": _w(5, 4)}, opset=20)
    g, _, after, _, _ = apply(m, fuse_conv_bias_act, feeds(x=[2, 3, 5], r=[2, 3, 4]))
    assert after == {"FusedMatMul": 1}
    assert g.nodes[0].attrs.has_residual == 1 and g.nodes[0].attrs.activation == "Gelu"


def test_no_fuse_conv_relu_conv_output_is_graph_output():
    m = _conv_model([node("Relu", ["t"], "y", name="relu")], outputs=("y", "t"))
    _, before, after, n, _ = apply(m, fuse_conv_bias_act, feeds(x=X))
    assert n == 0 and before == after


def test_no_fuse_conv_add_residual_needs_broadcast():
    tail = [node("Add", ["t", "r"], "y", name="add")]
    m = _conv_model(tail, extra_inputs={"r": [1, 4, 1, 1]})
    _, before, after, n, _ = apply(m, fuse_conv_bias_act, feeds(x=X, r=[1, 4, 1, 1]))
    assert n == 0 and before == after


def test_no_fuse_conv_relu_weight_not_constant():
    m = _conv_model([node("Relu", ["t"], "y", name="relu")], w_input=True)
    _, before, after, n, _ = apply(m, fuse_conv_bias_act, feeds(x=X, W=[4, 4, 3, 3]))
    assert n == 0 and before == after


def test_no_fuse_conv_relu_add_activation_before_residual():
    # relu(conv) + r is not act(conv + r): only conv + relu fuses, the Add stays
    tail = [node("Relu", ["t"], "u", name="relu"), node("Add", ["u", "r"], "y", name="add")]
    m = _conv_model(tail, extra_inputs={"r": X})
    g, _, after, _, _ = apply(m, fuse_conv_bias_act, feeds(x=X, r=X))
    assert after == {"Add": 1, "FusedConv": 1} and g.nodes[0].attrs.has_residual == 0
