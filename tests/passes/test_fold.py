"""Constant folding: structure, counts and numerics on small ONNX graphs, and where it must not
fire."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.engine.executor import Executor
from kiln.frontend import import_onnx
from kiln.kernels.torch.convert import to_numpy, to_torch
from kiln.passes import eliminate, fold
from kiln.passes.verifier import verify

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def make_model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    """``inputs``: (name, elem type, shape with str dims for symbols); outputs by name."""
    vin = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    vout = [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outputs]
    inits = [numpy_helper.from_array(a, n) for n, a in inits]
    g = helper.make_graph(nodes, "t", vin, vout, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def const(name: str, arr) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr)))


def run_passes(graph, passes, log=None) -> list[str]:
    logs: list[str] = []
    for name, fn in passes:
        fn(graph, logs.append)
        verify(graph, after=name)
    return logs


def run(graph, feeds: dict) -> list[np.ndarray]:
    outs = Executor(graph).run([to_torch(feeds[v.name]) for v in graph.inputs])
    return [to_numpy(o) for o in outs]


def assert_same_outputs(model, passes, feeds: dict) -> None:
    before, after = import_onnx(model), import_onnx(model)
    run_passes(after, passes)
    for a, b in zip(run(before, feeds), run(after, feeds)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


ALL = fold.PASSES + [("remove_dead_nodes", eliminate.remove_dead_nodes)]
rng = np.random.default_rng(0)


# ---------------------------------------------------------------- weights and Constant nodes


def weight_model():
    w = rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="tw", perm=[1, 0]),
             const("two", np.float32(2.0)),
             helper.make_node("Mul", ["wt", "two"], ["w2"], name="scale"),
             helper.make_node("MatMul", ["x", "w2"], ["y"], name="mm")]
    return make_model(nodes, [("x", F32, ["batch", 3])], ["y"], [("w", w)]), w


def test_fold_constants_weight_transform_structure():
    model, w = weight_model()
    g = import_onnx(model)
    logs = run_passes(g, ALL)
    assert [n.name for n in g.nodes] == ["mm"]
    wt = g.nodes[0].inputs[1]
    assert wt.producer is None and wt.type.shape == (3, 4)
    np.testing.assert_allclose(wt.const, w.T * 2)
    assert "w" not in g.weights  # the folded weight is no longer kept twice
    assert any("tw" in m and "Transpose" in m for m in logs)


def test_fold_constants_counts():
    model, _ = weight_model()
    g = import_onnx(model)
    assert g.op_counts() == {"Constant": 1, "MatMul": 1, "Mul": 1, "Transpose": 1}
    run_passes(g, ALL)
    assert g.op_counts() == {"MatMul": 1}


def test_fold_constants_numerics():
    model, _ = weight_model()
    assert_same_outputs(model, ALL, {"x": rng.standard_normal((5, 3)).astype(np.float32)})


def test_fold_constants_big_weight_transform_is_folded(monkeypatch):
    monkeypatch.setattr(fold, "FOLD_CAP", 16)  # the 48-byte weight is "huge" now
    model, _ = weight_model()
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"MatMul": 1}


def test_no_fuse_fold_expand_over_cap(monkeypatch):
    monkeypatch.setattr(fold, "FOLD_CAP", 1024)
    nodes = [const("one", np.ones((1,), np.float32)), const("shape", np.array([64, 64])),
             helper.make_node("Expand", ["one", "shape"], ["big"], name="expand"),
             helper.make_node("Add", ["x", "big"], ["y"], name="add")]
    g = import_onnx(make_model(nodes, [("x", F32, [64, 64])], ["y"]))
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1, "Expand": 1}


def test_no_fuse_fold_random():
    nodes = [helper.make_node("RandomNormal", [], ["r"], name="rand", shape=[2, 3]),
             helper.make_node("Add", ["x", "r"], ["y"], name="add")]
    g = import_onnx(make_model(nodes, [("x", F32, [2, 3])], ["y"]))
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1, "RandomNormal": 1}


def test_no_fuse_fold_graph_output():
    # a constant output would have nothing to fill it at run time
    nodes = [const("c", np.arange(3, dtype=np.float32)),
             helper.make_node("Relu", ["x"], ["y"], name="relu")]
    g = import_onnx(make_model(nodes, [("x", F32, [3])], ["y", "c"]))
    run_passes(g, ALL)
    assert g.op_counts() == {"Constant": 1, "Relu": 1}
    out = run(g, {"x": np.ones(3, np.float32)})
    np.testing.assert_array_equal(out[1], np.arange(3, dtype=np.float32))


# ---------------------------------------------------------------- shape subgraphs

#   x [batch, seq, 8] ─Shape─Gather(0)─Unsqueeze─┐
#                      [-1], [2], [4] ───────────┴─Concat─ Reshape(x, ·) -> [batch, seq, 2, 4]


def shape_chain_model():
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             const("i0", np.int64(0)), const("ax", np.array([0])),
             helper.make_node("Gather", ["s", "i0"], ["b"], name="gather"),
             helper.make_node("Unsqueeze", ["b", "ax"], ["b1"], name="unsq"),
             const("rest", np.array([-1, 2, 4])),
             helper.make_node("Concat", ["b1", "rest"], ["target"], name="concat", axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape")]
    return make_model(nodes, [("x", F32, ["batch", "seq", 8])], ["y"])


def test_fold_shape_inputs_structure():
    g = import_onnx(shape_chain_model())
    run_passes(g, ALL)
    (node,) = g.nodes
    assert node.name == "reshape" and node.inputs[0] is g.inputs[0]
    assert node.inputs[1].const.tolist() == [0, -1, 2, 4]  # 0 copies the input's batch


def test_fold_shape_inputs_counts():
    g = import_onnx(shape_chain_model())
    assert g.op_counts() == {"Concat": 1, "Constant": 3, "Gather": 1, "Reshape": 1, "Shape": 1,
                             "Unsqueeze": 1}
    run_passes(g, ALL)
    assert g.op_counts() == {"Reshape": 1}


@pytest.mark.parametrize("shape", [(1, 5, 8), (3, 2, 8)])
def test_fold_shape_inputs_numerics(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    assert_same_outputs(shape_chain_model(), ALL, {"x": x})


def test_fold_constants_static_shape():
    # Shape of a fully static tensor is a constant; so is Shape(x)[1] when only dim 1 is static
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Shape", ["z"], ["sz"], name="shape_z"),
             const("i1", np.int64(1)),
             helper.make_node("Gather", ["sz", "i1"], ["d"], name="dim1"),
             helper.make_node("Cast", ["d"], ["df"], name="cast", to=F32),
             helper.make_node("Cast", ["s"], ["sf"], name="cast_s", to=F32),
             helper.make_node("Mul", ["sf", "df"], ["y"], name="mul")]
    model = make_model(nodes, [("x", F32, [2, 3]), ("z", F32, ["n", 7])], ["y"])
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"Mul": 1}
    np.testing.assert_array_equal(g.nodes[0].inputs[0].const, [2.0, 3.0])
    np.testing.assert_array_equal(g.nodes[0].inputs[1].const, 7.0)
    feeds = {"x": np.zeros((2, 3), np.float32), "z": np.zeros((4, 7), np.float32)}
    assert_same_outputs(model, ALL, feeds)


def test_no_fuse_fold_shape_inputs_two_symbolic_dims():
    # [batch*seq, 8] -> [batch, seq, 8]: no constant target says that (0 copies the same index)
    nodes = [helper.make_node("Shape", ["a"], ["s"], name="shape"),
             const("idx", np.array([0, 1])),
             helper.make_node("Gather", ["s", "idx"], ["bs"], name="gather"),
             const("last", np.array([8])),
             helper.make_node("Concat", ["bs", "last"], ["target"], name="concat", axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape")]
    model = make_model(nodes, [("a", F32, ["batch", "seq"]), ("x", F32, ["batch*seq", 8])],
                       ["y"])
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"Concat": 1, "Gather": 1, "Reshape": 1, "Shape": 1}
    feeds = {"a": np.zeros((2, 3), np.float32), "x": rng.standard_normal((6, 8)).astype("f4")}
    assert_same_outputs(model, ALL, feeds)


def test_no_fuse_fold_shape_inputs_allowzero():
    # with allowzero a 0 in the target is a literal size, so [batch, -1] cannot become [0, -1]
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             const("idx", np.array([0])),
             helper.make_node("Gather", ["s", "idx"], ["b"], name="gather"),
             const("rest", np.array([-1])),
             helper.make_node("Concat", ["b", "rest"], ["target"], name="concat", axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape", allowzero=1)]
    g = import_onnx(make_model(nodes, [("x", F32, ["batch", 4, 2])], ["y"]))
    run_passes(g, ALL)
    assert g.op_counts()["Reshape"] == 1 and g.op_counts()["Shape"] == 1


def test_no_fuse_fold_kernel_error():
    # a node that cannot run on its constants stays, so the error appears at run time
    nodes = [const("v", np.arange(6, dtype=np.float32)), const("s", np.array([4])),
             helper.make_node("Reshape", ["v", "s"], ["bad"], name="bad_reshape"),
             helper.make_node("Add", ["x", "bad"], ["y"], name="add")]
    g = import_onnx(make_model(nodes, [("x", F32, [4])], ["y"]))
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1, "Reshape": 1}


def test_no_fuse_fold_subgraph_op():
    branch = [helper.make_graph([const("o", np.float32(v))], f"b{v}", [],
                                [helper.make_tensor_value_info("o", F32, [])]) for v in (1, 2)]
    nodes = [const("cond", np.bool_(True)),
             helper.make_node("If", ["cond"], ["c"], name="if", then_branch=branch[0],
                              else_branch=branch[1]),
             helper.make_node("Add", ["x", "c"], ["y"], name="add")]
    model = make_model(nodes, [("x", F32, [2])], ["y"])
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1, "If": 1}
    assert_same_outputs(model, ALL, {"x": np.zeros(2, np.float32)})


def _captured_weight_model(outer_const: bool):
    """An If whose then branch slices and unsqueezes an outer value (silero-vad's LSTM weights,
    cut from outer constants inside the branch); ``outer_const``: that value is a weight, else
    a graph input."""
    w = rng.standard_normal((4, 3)).astype(np.float32)
    then_g = helper.make_graph(
        [const("s0", np.array([0], np.int64)), const("s1", np.array([2], np.int64)),
         helper.make_node("Slice", ["w", "s0", "s1"], ["ws"], name="cut"),
         helper.make_node("MatMul", ["x", "ws"], ["t"], name="mm_then")],
        "then", [], [helper.make_tensor_value_info("t", F32, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"], name="id")], "else",
                               [], [helper.make_tensor_value_info("e", F32, None)])
    node = helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g,
                            else_branch=else_g)
    inputs = [("x", F32, [2, 2]), ("cond", TensorProto.BOOL, [])]
    if not outer_const:
        inputs.append(("w", F32, [4, 3]))
    return make_model([node], inputs, ["y"], [("w", w)] if outer_const else []), w


def _then_branch(g):
    return next(n for n in g.nodes if n.op.name == "If").attrs.then_branch


def test_fold_through_constant_capture_structure_and_counts():
    model, w = _captured_weight_model(outer_const=True)
    g = import_onnx(model)
    assert _then_branch(g).op_counts() == {"Constant": 2, "MatMul": 1, "Slice": 1}
    run_passes(g, ALL)
    then = _then_branch(g)
    assert then.op_counts() == {"MatMul": 1}
    np.testing.assert_array_equal(then.nodes[0].inputs[1].const, w[:2])


def test_fold_through_constant_capture_numerics():
    model, _ = _captured_weight_model(outer_const=True)
    x = rng.standard_normal((2, 2)).astype(np.float32)
    for cond in (True, False):
        assert_same_outputs(model, ALL, {"x": x, "cond": np.array(cond)})


def test_no_fold_capture_of_graph_input():
    model, _ = _captured_weight_model(outer_const=False)
    g = import_onnx(model)
    run_passes(g, ALL)
    assert _then_branch(g).op_counts() == {"MatMul": 1, "Slice": 1}
    x = rng.standard_normal((2, 2)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    assert_same_outputs(model, ALL, {"x": x, "cond": np.array(True), "w": w})


# ---------------------------------------------------------------- x * 0 of integers


def _zero_product_model(dtype=I64, zero=0):
    """y = x + Cast(n * 0): silero-vad's way of adding nothing to its state."""
    zero = np.asarray(zero, np.int64 if dtype == I64 else np.float32)
    nodes = [const("zero", zero), helper.make_node("Mul", ["n", "zero"], ["z"], name="mul"),
             helper.make_node("Cast", ["z"], ["zf"], name="cast", to=F32),
             helper.make_node("Add", ["x", "zf"], ["y"], name="add")]
    return make_model(nodes, [("x", F32, [2, 3]), ("n", dtype, [])], ["y"])


def test_fold_int_times_zero_structure_and_numerics():
    model = _zero_product_model()
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1}
    assert g.nodes[0].inputs[1].const == 0.0
    feeds = {"x": rng.standard_normal((2, 3)).astype(np.float32), "n": np.int64(16000)}
    assert_same_outputs(model, ALL, feeds)


def test_no_fold_float_times_zero():
    """(NaN * 0 is NaN: a float product by zero stays a node)"""
    model = _zero_product_model(F32)
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts()["Mul"] == 1


def test_no_fold_int_times_nonzero():
    g = import_onnx(_zero_product_model(zero=[0, 2, 1]))
    run_passes(g, ALL)
    assert g.op_counts()["Mul"] == 1
