"""The ONNX frontend: sources, external data, opsets, symbolic shapes, and every load error."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln.onnx_backend as backend
from kiln.errors import ModelLoadError, UnsupportedOpsError
from kiln.frontend import import_onnx
from kiln.ir.types import sym


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _mlp_with_weight():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])


def test_frontend_loads_path_bytes_and_proto(tmp_path):
    m = _mlp_with_weight()
    onnx.save(m, tmp_path / "m.onnx")
    for src in (tmp_path / "m.onnx", str(tmp_path / "m.onnx"), m.SerializeToString(), m):
        g = import_onnx(src)
        assert [n.op.name for n in g.nodes] == ["MatMul"] and "w" in g.weights
        assert g.outputs[0].type.shape == (sym("n"), 3)


def test_frontend_external_data_round_trip(tmp_path):
    m = _mlp_with_weight()
    x = np.ones((2, 4), np.float32)
    want = x @ numpy_helper.to_array(m.graph.initializer[0])  # before save moves the data out
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.bin", size_threshold=0)
    assert (tmp_path / "m.bin").exists()
    got = backend.prepare(str(tmp_path / "m.onnx")).run([x])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_frontend_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_onnx(tmp_path / "nope.onnx")


def test_frontend_malformed_protobuf(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"\x08\x07\x12\xff\xff\xff garbage that is not a model")
    with pytest.raises(ModelLoadError, match="bad.onnx is not a valid ONNX model"):
        import_onnx(p)


def test_frontend_truncated_model(tmp_path):
    p = tmp_path / "cut.onnx"
    data = _mlp_with_weight().SerializeToString()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.onnx"):
        import_onnx(p)


def test_frontend_missing_external_data(tmp_path):
    m = _mlp_with_weight()
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.bin",
              size_threshold=0)
    (tmp_path / "m.bin").unlink()
    with pytest.raises(ModelLoadError, match="tensor 'w' needs external data file 'm.bin'"):
        import_onnx(tmp_path / "m.onnx")


@pytest.mark.parametrize("location", ["/etc/passwd", "../secret.bin", "sub/../../x.bin"])
def test_frontend_refuses_external_data_outside_folder(tmp_path, location):
    m = _mlp_with_weight()
    t = m.graph.initializer[0]
    t.data_location = TensorProto.EXTERNAL
    t.ClearField("raw_data")
    t.ClearField("float_data")
    e = t.external_data.add()
    e.key, e.value = "location", location
    (tmp_path / "d").mkdir()
    onnx.save(m, tmp_path / "d" / "m.onnx")
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        import_onnx(tmp_path / "d" / "m.onnx")


def test_frontend_unknown_input_dtype():
    m = _mlp_with_weight()
    m.graph.input[0].type.tensor_type.elem_type = 99
    with pytest.raises(ModelLoadError, match="graph input 'x' has element type 99"):
        import_onnx(m)


def test_frontend_lists_every_unsupported_op_at_once():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("FancyOp", ["a"], ["b"], name="first_bad"),
             helper.make_node("Warp", ["b"], ["c"], name="second_bad", domain="com.acme"),
             helper.make_node("Relu", ["c"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m.opset_import.append(helper.make_opsetid("com.acme", 3))
    with pytest.raises(UnsupportedOpsError) as info:
        import_onnx(m)
    msg = str(info.value)
    assert "2 unsupported node(s)" in msg
    assert "node 'first_bad': op 'FancyOp' (domain 'ai.onnx', opset 17)" in msg
    assert "node 'second_bad': op 'Warp' (domain 'com.acme', opset 3)" in msg


def test_frontend_expands_function_ops():
    # Mish has no OpDef of its own in some versions; whatever kiln has, the result must match
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    m = _model([helper.make_node("Mish", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], opset=18)
    np.testing.assert_allclose(backend.prepare(m).run([x])[0],
                               x * np.tanh(np.log1p(np.exp(x))), rtol=1e-5)


@pytest.mark.parametrize("opset", [7, 9, 11, 13, onnx.defs.onnx_opset_version()])
def test_frontend_opsets_7_to_newest(opset):
    nodes = [helper.make_node("Add", ["x", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    b = numpy_helper.from_array(np.array([1.0, -1.0, 2.0], np.float32), "b")
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [b], opset)
    x = np.array([[0.5, 0.5, -3.0], [-2.0, 2.0, 1.0]], np.float32)
    np.testing.assert_array_equal(backend.prepare(m).run([x])[0], np.maximum(x + [1, -1, 2], 0))


def test_frontend_dynamic_batch_stays_symbolic_through_shape_arithmetic():
    # x[batch, seq, 8] -> Reshape(x, Concat(Shape(x)[0], Shape(x)[1]*2, 4)) -> [batch, 2*seq, 4]
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["s", "i1"], ["q"], axis=0),
             helper.make_node("Mul", ["q", "two"], ["q2"]),
             helper.make_node("Concat", ["b", "q2", "four"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "i0"),
             numpy_helper.from_array(np.array([1], np.int64), "i1"),
             numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([4], np.int64), "four")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                     ["batch", "seq", 8])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    g = import_onnx(m)
    batch, seq = sym("batch"), sym("seq")
    assert g.outputs[0].type.shape == (batch, 2 * seq, 4)
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    assert backend.prepare(m).run([x])[0].shape == (2, 6, 4)
