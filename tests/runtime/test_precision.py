"""FP16/BF16 lowering (kiln.builder.precision), checked on the CPU: structure and numerics."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.precision import lower_precision
from kiln.frontend import import_onnx
from kiln.ir import DType
from tests.engine.models import mlp, mlp_reference

# max|out - ref| / max|ref| allowed against the FP32 engine
TOL = {"fp16": 1e-2, "bf16": 4e-2}


def _build(model, **cfg):
    return kiln.Builder(kiln.BuilderConfig(**cfg)).build(model)


def _rel(a, b) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / (np.max(np.abs(b)) or 1.0))


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_precision_mlp_matches_fp32(precision):
    model = mlp(hidden=32)
    engine = _build(model, **{precision: True})
    low = DType.float16 if precision == "fp16" else DType.bfloat16
    assert {w.const.dtype for w in engine.graph.weights.values()} == {low.np}
    assert [(i.dtype, o.dtype) for i, o in zip(engine.inputs, engine.outputs)] == [
        (DType.float32, DType.float32)]
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    y = engine.create_context().run({"x": x})["y"]
    assert y.dtype == np.float32
    assert _rel(y, mlp_reference(x, model)) < TOL[precision]


def test_precision_casts_only_at_graph_io():
    engine = _build(mlp(), fp16=True)
    casts = [n for n in engine.graph.nodes if n.op.name == "Cast"]
    assert len(casts) == 2
    assert casts[0].inputs[0] is engine.graph.inputs[0]
    assert engine.graph.outputs[0].producer is casts[1]
    assert engine.graph.outputs[0].name == "y"
    layers = {r["name"]: r["precision"] for r in engine.layers()}
    assert layers[casts[1].name] == "float32"
    assert sum(p == "float16" for p in layers.values()) == len(layers) - 1


def test_precision_engine_file_keeps_fp16_weights(tmp_path):
    engine = _build(mlp(), fp16=True)
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    want = engine.create_context().run({"x": x})["y"]
    fp32_bytes = _build(mlp()).weight_bytes
    assert engine.weight_bytes * 2 == fp32_bytes
    engine.save(tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    assert loaded.weight_bytes == engine.weight_bytes
    np.testing.assert_array_equal(loaded.create_context().run({"x": x})["y"], want)


def _square_sum_model():
    """x[2, 4] * w -> Pow 2 -> ReduceSum(axis 1) -> y; with x ~ 300 the squares pass FP16's
    maximum (65504)."""
    w = numpy_helper.from_array(np.full((4,), 1.5, np.float32), "w")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"),
             helper.make_node("Pow", ["xw", "two"], ["sq"], name="square"),
             helper.make_node("ReduceSum", ["sq", "axes"], ["y"], name="total", keepdims=0)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                  [w, two, axes])


def test_precision_pins_overflow_prone_ops_to_fp32():
    engine = _build(_square_sum_model(), fp16=True, optimize=False)
    by_name = {n.name: n for n in engine.graph.nodes}
    assert by_name["scale"].outputs[0].type.dtype == DType.float16
    assert by_name["square"].outputs[0].type.dtype == DType.float32
    assert by_name["square"].inputs[0].type.dtype == DType.float32  # cast back up
    x = np.full((2, 4), 300.0, np.float32)
    y = engine.create_context().run({"x": x})["y"]
    np.testing.assert_allclose(y, [4 * 450.0**2] * 2, rtol=1e-3)


def test_no_lower_nodes_named_in_keep_fp32():
    graph = import_onnx(mlp())
    stats = lower_precision(graph, "fp16", keep_fp32={"relu1"})
    node = {n.name: n for n in graph.nodes}["relu1"]
    assert stats["fp32"] == ["relu1"]
    assert node.inputs[0].type.dtype == node.outputs[0].type.dtype == DType.float32
    assert stats["casts"] == 4  # input down, around relu1 (up, down), output up


def test_precision_retargets_cast_to_float():
    w = numpy_helper.from_array(np.full((3,), 0.5, np.float32), "w")
    nodes = [helper.make_node("Cast", ["ids"], ["f"], name="to_float", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "w"], ["y"], name="scale")]
    model = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    engine = _build(model, fp16=True, optimize=False)
    cast = {n.name: n for n in engine.graph.nodes}["to_float"]
    assert cast.attrs.to == TensorProto.FLOAT16
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    y = engine.create_context().run({"ids": ids})["y"]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ids * 0.5)


def test_precision_leaves_integer_graphs_alone():
    nodes = [helper.make_node("Add", ["a", "a"], ["y"], name="twice")]
    model = _model(nodes, [helper.make_tensor_value_info("a", TensorProto.INT64, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.INT64, [3])])
    graph = import_onnx(model)
    stats = lower_precision(graph, "fp16")
    assert stats["low"] == 0 and stats["casts"] == 0
    assert [n.op.name for n in graph.nodes] == ["Add"]


def test_precision_rejects_unknown_precision():
    with pytest.raises(ValueError, match="fp16"):
        lower_precision(import_onnx(mlp()), "fp8")


TINY_BERT = {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128, "vocab": 1000}


@pytest.fixture(scope="module")
def tiny_bert() -> str:
    from kiln.zoo import build_onnx

    return str(build_onnx("bert-base", **TINY_BERT))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_precision_bert_matches_fp32(tiny_bert, precision):
    """LayerNorm statistics and softmax stay FP32 inside their kernels; the mask arithmetic
    runs in the low type (-10000 is representable)."""
    from kiln.zoo import sample_inputs

    feeds = sample_inputs("bert-base", batch=2, seq=16, **TINY_BERT)
    ref = _build(tiny_bert).create_context().run(feeds)["last_hidden_state"]
    engine = _build(tiny_bert, **{precision: True})
    norms = [n for n in engine.graph.nodes if n.op.name == "LayerNormalization"]
    assert norms and all(n.inputs[1].type.dtype == DType.float32 for n in norms)
    assert all(n.outputs[0].type.dtype != DType.float32 for n in norms)
    got = engine.create_context().run(feeds)["last_hidden_state"]
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert _rel(got, ref) < TOL[precision]



def test_low_precision_io_takes_and_gives_fp16():
    model = mlp(hidden=32)
    engine = _build(model, fp16=True, low_precision_io=True)
    assert [(i.dtype, o.dtype) for i, o in zip(engine.inputs, engine.outputs)] == [
        (DType.float16, DType.float16)]
    assert not any(n.op.name == "Cast" for n in engine.graph.nodes)  # nothing at the edges
    assert [i.name for i in engine.inputs] == ["x"] and [o.name for o in engine.outputs] == ["y"]
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    y = engine.create_context().run({"x": x.astype(np.float16)})["y"]
    assert y.dtype == np.float16
    assert _rel(y.astype(np.float32), mlp_reference(x, model)) < TOL["fp16"]
    with pytest.raises(kiln.ShapeError, match="float16"):
        engine.create_context().run({"x": x})  # float32 in: refused, naming the dtype


def test_low_precision_io_with_a_pinned_first_and_last_node():
    """Exp is pinned to FP32: the FP16 input is cast up for it, and its FP32 result cast down
    for the FP16 output, which keeps its name."""
    nodes = [helper.make_node("Exp", ["x"], ["y"], name="exp")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    engine = _build(model, fp16=True, low_precision_io=True)
    assert engine.inputs[0].dtype == engine.outputs[0].dtype == DType.float16
    assert engine.outputs[0].name == "y"
    x = np.array([0.0, 1.0, -2.0], np.float16)
    y = engine.create_context().run({"x": x})["y"]
    np.testing.assert_allclose(y.astype(np.float32), np.exp(x.astype(np.float32)), rtol=2e-3)


def test_low_precision_io_needs_a_low_precision():
    with pytest.raises(ValueError, match="fp16 or bf16"):
        kiln.BuilderConfig(low_precision_io=True)
