"""Small ONNX models written with onnx.helper for engine and CLI tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(path=None, hidden: int = 16) -> onnx.ModelProto:
    """x[batch, 8] -> MatMul -> Add -> Relu -> MatMul -> y[batch, 4]; batch is symbolic."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, hidden)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((hidden, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["a"], name="relu1"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="fc2")]
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                          [w1, b1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    if path is not None:
        onnx.save(m, str(path))
    return m


def mlp_reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"]


def two_inputs() -> onnx.ModelProto:
    """a[batch, seq] + b[batch, seq] -> y; both share symbolic dims."""
    nodes = [helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    g = helper.make_graph(nodes, "two",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq"]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "seq"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
