"""RNN / GRU / LSTM kernels against onnx.reference (and onnxruntime where the reference ignores
an attribute, e.g. sequence_lens, activations, clip)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kiln.frontend.convert import import_onnx
from tests.ops.harness import assert_close, check_against_reference, node_model, run_kiln

RNG = np.random.default_rng(0)
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _inputs(kind, seq=4, batch=3, inp=5, hid=6, dirs=1, layout=0, bias=True):
    g = GATES[kind]
    x_shape = (batch, seq, inp) if layout else (seq, batch, inp)
    d = {"X": RNG.standard_normal(x_shape).astype(np.float32),
         "W": (RNG.standard_normal((dirs, g * hid, inp)) * 0.5).astype(np.float32),
         "R": (RNG.standard_normal((dirs, g * hid, hid)) * 0.5).astype(np.float32)}
    if bias:
        d["B"] = (RNG.standard_normal((dirs, 2 * g * hid)) * 0.3).astype(np.float32)
    return d


def _run_ort(model, inputs):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for o in model.graph.output:  # onnxruntime wants typed graph outputs
        o.type.tensor_type.elem_type = TensorProto.FLOAT
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_directions_match_reference(kind, direction):
    dirs = 2 if direction == "bidirectional" else 1
    inputs = _inputs(kind, dirs=dirs)
    n_out = 3 if kind == "LSTM" else 2
    m = node_model(kind, inputs, n_out=n_out, hidden_size=6, direction=direction)
    check_against_reference(m, inputs)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_layout_1(kind):
    inputs = _inputs(kind, layout=1)
    m = node_model(kind, inputs, n_out=2, hidden_size=6, layout=1)
    check_against_reference(m, inputs)


def test_gru_linear_before_reset():
    inputs = _inputs("GRU", dirs=2)
    m = node_model("GRU", inputs, n_out=2, hidden_size=6, direction="bidirectional",
                   linear_before_reset=1)
    check_against_reference(m, inputs)


def test_lstm_seq_lens_states_peepholes_vs_ort():
    hid, batch, dirs = 6, 3, 2
    inputs = _inputs("LSTM", dirs=dirs)
    inputs["sequence_lens"] = np.array([4, 2, 1], np.int32)
    inputs["initial_h"] = RNG.standard_normal((dirs, batch, hid)).astype(np.float32)
    inputs["initial_c"] = RNG.standard_normal((dirs, batch, hid)).astype(np.float32)
    inputs["P"] = RNG.standard_normal((dirs, 3 * hid)).astype(np.float32)
    m = node_model("LSTM", inputs, n_out=3, hidden_size=hid, direction="bidirectional",
                   opset=14)
    for g, w in zip(run_kiln(m, inputs), _run_ort(m, inputs)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_rnn_activations_and_clip_vs_ort():
    inputs = _inputs("RNN", dirs=2)
    inputs["sequence_lens"] = np.array([3, 4, 1], np.int32)
    m = node_model("RNN", inputs, n_out=2, hidden_size=6, direction="bidirectional",
                   activations=["Relu", "LeakyRelu"], activation_alpha=[0.2], clip=1.5,
                   opset=14)
    for g, w in zip(run_kiln(m, inputs), _run_ort(m, inputs)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_optional_outputs_only_last_state():
    inputs = _inputs("GRU")
    node = helper.make_node("GRU", list(inputs), ["", "yh"], hidden_size=6)
    vin = [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in inputs.items()]
    vout = [helper.make_tensor_value_info("yh", TensorProto.FLOAT, None)]
    m = helper.make_model(helper.make_graph([node], "t", vin, vout))
    want = _run_ort(m, inputs)
    assert_close(run_kiln(m, inputs)[0], want[0])


def test_shape_rule_symbolic():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["S", "N", 5])
    w = helper.make_tensor_value_info("W", TensorProto.FLOAT, [2, 24, 5])
    r = helper.make_tensor_value_info("R", TensorProto.FLOAT, [2, 24, 6])
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y", "Yh", "Yc"], hidden_size=6,
                            direction="bidirectional")
    outs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
            for o in ("Y", "Yh", "Yc")]
    g = import_onnx(helper.make_model(helper.make_graph([node], "t", [x, w, r], outs)))
    shapes = [tuple(str(d) for d in v.type.shape) for v in g.outputs]
    assert shapes == [("S", "2", "N", "6"), ("2", "N", "6"), ("2", "N", "6")]


def test_unknown_activation_rejected():
    inputs = _inputs("RNN")
    m = node_model("RNN", inputs, n_out=2, hidden_size=6, activations=["Bogus"])
    m.ir_version = onnx.IR_VERSION
    with pytest.raises(Exception, match="activation|Bogus"):
        run_kiln(m, inputs)
