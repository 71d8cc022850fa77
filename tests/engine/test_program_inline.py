"""If nodes whose condition the input signature fixes, inlined into a native program's plan
(kiln.engine.program_inline): a branch on a dim of a dynamic input (and, nested in it, one on
the rank), and one on a constant; outputs match onnxruntime for each shape, each shape gets
its own plan, and no If is left as a torch record. A condition the data sets keeps the If
(on the Python loop)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
mk = helper.make_node


def _arr(name, x):
    return numpy_helper.from_array(np.asarray(x), name)


def _out(name):
    return [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)]


def _model() -> onnx.ModelProto:
    """x [n, 4]: y = Relu(If(rank(s) == 1, Neg(s), s)) with s = Squeeze(x, 0), if n == 1;
    else Sigmoid(x) * 2 (the else branch reads a constant of its own)."""
    inner = mk("If", ["rank1"], ["t"],
               then_branch=helper.make_graph([mk("Neg", ["s"], ["t1"])], "t", [], _out("t1")),
               else_branch=helper.make_graph([mk("Identity", ["s"], ["t2"])], "e", [],
                                             _out("t2")))
    then = helper.make_graph(
        [mk("Squeeze", ["x", "zero"], ["s"]), mk("Shape", ["s"], ["ss"]),
         mk("Size", ["ss"], ["rank"]), mk("Equal", ["rank", "one"], ["rank1"]), inner,
         mk("Relu", ["t"], ["a"])], "then", [], _out("a"))
    other = helper.make_graph(
        [mk("Sigmoid", ["x"], ["g"]), mk("Mul", ["g", "two"], ["b"])], "else", [], _out("b"),
        [_arr("two", np.float32(2))])
    nodes = [mk("Shape", ["x"], ["sh"]), mk("Gather", ["sh", "zero_s"], ["n"], axis=0),
             mk("Equal", ["n", "one"], ["c"]),
             mk("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 4])], _out("y"),
        [_arr("zero", np.array([0], np.int64)), _arr("zero_s", np.int64(0)),
         _arr("one", np.int64(1))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _build(model, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    return engine, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _torch_ops(program, n_rows: int) -> Counter:
    plans = [p for sig, p in program.plans.items() if p and sig[0][0][0] == n_rows]
    assert len(plans) == 1
    return Counter(fb.step.node.op.name for fb in plans[0].fallbacks)


def test_if_on_a_dim_is_inlined_per_shape(tmp_path):
    engine, sess = _build(_model(), tmp_path)
    ctx = engine.create_context()
    rng = np.random.default_rng(0)
    for n in (1, 3, 1, 3):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        for _ in range(2):  # traced, then planned
            got, want = ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0]
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    program = engine._executor.program
    assert not program.disabled
    for n in (1, 3):
        assert not _torch_ops(program, n)


def test_if_on_a_constant_is_inlined(tmp_path):
    """x [1, 4] static: the build folds the condition to a constant True."""
    m = _model()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    engine, sess = _build(m, tmp_path)
    ctx = engine.create_context()
    x = np.random.default_rng(1).standard_normal((1, 4)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_allclose(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0],
                                   rtol=1e-6)
    assert not _torch_ops(engine._executor.program, 1)


def test_no_inline_of_an_if_on_data(tmp_path):
    """The condition is sum(x) > 0: float data turned into a branch, which kiln.engine.value_flow
    keeps from programs (the Python loop runs the If), both ways right."""
    m = _model()
    g = m.graph
    del g.node[:3]
    g.node.insert(0, mk("ReduceSum", ["x"], ["sum"], keepdims=0))
    g.node.insert(1, mk("Greater", ["sum", "zf"], ["c"]))
    g.initializer.append(_arr("zf", np.float32(0)))
    g.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    engine, sess = _build(m, tmp_path)
    ctx = engine.create_context()
    for sign in (1, -1, 1):
        x = sign * np.abs(np.random.default_rng(2).standard_normal((1, 4))).astype(np.float32)
        for _ in range(2):
            np.testing.assert_allclose(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0],
                                       rtol=1e-6)
    ex = engine._executor
    assert ex.program is None and "If" in ex.program_blocked
