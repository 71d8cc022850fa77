"""Attention-style ops: single-node models against onnx.reference, plus shape rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from kiln.errors import KilnError
from kiln.frontend.convert import import_onnx
from kiln.ir.types import sym
from kiln.kernels.registry import Call
from kiln.kernels.torch import attention as KA
from kiln.ops import attention as A
from tests.ops.harness import check_against_reference, node_model, run_kiln

RNG = np.random.default_rng(0)


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _attention(inputs, n_out=1, opset=24, **attrs):
    model = node_model("Attention", inputs, n_out=n_out, opset=opset, **attrs)
    check_against_reference(model, inputs)


@pytest.mark.parametrize("attrs", [{}, {"is_causal": 1}, {"scale": 0.1}, {"softcap": 2.0}])
def test_attention_4d_gqa(attrs):
    _attention({"q": _f32(2, 4, 3, 8), "k": _f32(2, 2, 5, 8), "v": _f32(2, 2, 5, 6)}, **attrs)


def test_attention_3d_bool_mask_past_and_qk_output():
    inputs = {"q": _f32(1, 3, 16), "k": _f32(1, 2, 16), "v": _f32(1, 2, 16),
              "mask": RNG.integers(0, 2, (3, 6)).astype(bool),
              "pk": _f32(1, 2, 4, 8), "pv": _f32(1, 2, 4, 8)}
    for mode in (0, 2, 3):
        _attention(inputs, n_out=4, q_num_heads=2, kv_num_heads=2, is_causal=1,
                   qk_matmul_output_mode=mode)


def test_attention_nonpad_kv_seqlen_fully_masked_rows_are_zero():
    inputs = {"q": _f32(2, 2, 4, 8), "k": _f32(2, 2, 6, 8), "v": _f32(2, 2, 6, 8)}
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Attention", ["q", "k", "v", "", "", "", "n"], ["y"], is_causal=1)],
        "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
              for k, v in inputs.items()]
        + [helper.make_tensor_value_info("n", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
        opset_imports=[helper.make_opsetid("", 24)])
    inputs["n"] = np.array([2, 6], np.int64)
    check_against_reference(model, inputs)
    (y,) = run_kiln(model, inputs)
    assert np.all(y[0, :, :2] == 0)  # offset -2: first two queries see no key


def test_attention_fast_path_matches_explicit():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    call = Call(A.Attention.make_attrs(is_causal=1), 1, 3)
    fast = KA.attention(call, q, k, v)[0]
    slow, _ = KA._explicit(call, q, k, v, KA.attention_bias(call, q, None, None, None, 5),
                           8 ** -0.5)
    torch.testing.assert_close(fast, slow)


def test_attention_symbolic_shape_rule():
    dims = {"q": ["b", "s", 64], "k": ["b", "t", 32], "v": ["b", "t", 32]}
    vin = [helper.make_tensor_value_info(k, TensorProto.FLOAT, d) for k, d in dims.items()]
    vin += [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["b", 2, "p", 16])
            for k in ("pk", "pv")]
    outs = ["y", "present_k", "present_v"]
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], outs,
                            q_num_heads=4, kv_num_heads=2)
    model = helper.make_model(helper.make_graph(
        [node], "g", vin, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                           for o in outs]), opset_imports=[helper.make_opsetid("", 23)])
    g = import_onnx(model)
    b, s, t, p = sym("b"), sym("s"), sym("t"), sym("p")
    assert g.outputs[0].type.shape == (b, s, 64)
    assert g.outputs[1].type.shape == (b, 2, p + t, 16)


def test_attention_bad_heads_raises():
    inputs = {"q": _f32(1, 3, 10), "k": _f32(1, 3, 10), "v": _f32(1, 3, 10)}
    model = node_model("Attention", inputs, opset=23, q_num_heads=3, kv_num_heads=3)
    with pytest.raises(KilnError):
        run_kiln(model, inputs)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(interleaved):
    inputs = {"x": _f32(2, 3, 4, 8), "cos": _f32(10, 2), "sin": _f32(10, 2),
              "pos": RNG.integers(0, 10, (2, 4)).astype(np.int64)}
    model = node_model("RotaryEmbedding", inputs, opset=23, interleaved=interleaved,
                       rotary_embedding_dim=4)
    check_against_reference(model, inputs)


def test_tensor_scatter_circular():
    inputs = {"past": _f32(2, 3, 4, 5), "upd": _f32(2, 3, 3, 5),
              "idx": np.array([1, 3], np.int64)}
    check_against_reference(node_model("TensorScatter", inputs, opset=24, mode="circular"),
                            inputs)


def test_swiglu():
    inputs = {"a": _f32(3, 4), "b": _f32(3, 4)}
    check_against_reference(node_model("SwiGLU", inputs, opset=28, alpha=0.7), inputs)


def test_causal_conv_with_state():
    inputs = {"x": _f32(2, 3, 5), "w": _f32(3, 1, 3), "bias": _f32(3), "past": _f32(2, 3, 2)}
    model = node_model("CausalConvWithState", inputs, n_out=2, opset=27, activation="silu")
    check_against_reference(model, inputs)


@pytest.mark.parametrize("rule", ["linear", "gated_delta"])
def test_linear_attention(rule):
    inputs = {"q": _f32(2, 3, 16), "k": _f32(2, 3, 8), "v": _f32(2, 3, 8)}
    if rule == "gated_delta":
        inputs.update(past=_f32(2, 2, 4, 4), decay=-abs(_f32(2, 3, 2)),
                      beta=abs(_f32(2, 3, 2)) / 3)
    model = node_model("LinearAttention", inputs, n_out=2, opset=27, q_num_heads=4,
                       kv_num_heads=2, update_rule=rule)
    check_against_reference(model, inputs)


def test_flex_attention_with_score_mod():
    inputs = {"q": _f32(1, 4, 3, 8), "k": _f32(1, 2, 5, 8), "v": _f32(1, 2, 5, 8)}
    tanh = helper.make_graph([helper.make_node("Tanh", ["s"], ["o"])], "mod",
                             [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    model = node_model("FlexAttention", inputs, domain="ai.onnx.preview", score_mod=tanh)
    check_against_reference(model, inputs)
