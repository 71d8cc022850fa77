"""Native programs and integer inputs: a program is planned per input signature, so it runs a
graph whose integer inputs only reach plain data (ids gathered from a table, a mask in the
arithmetic) as one plan, and one whose values could set a shape or a branch
(kiln.engine.value_flow) with a plan per value of those inputs. Either way the outputs match
onnxruntime for several values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")

mk = helper.make_node


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _build(model, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    return engine, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _arr(name, x):
    return numpy_helper.from_array(np.asarray(x), name)


def _ids_model() -> onnx.ModelProto:
    """y = tanh(table[ids] * w) + (1 - mask) * -100: token ids into an embedding and an
    attention mask cast into the arithmetic."""
    rng = np.random.default_rng(0)
    inits = [_arr("table", rng.standard_normal((10, 4)).astype(np.float32)),
             _arr("w", rng.standard_normal(4).astype(np.float32)),
             _arr("one", np.float32(1)), _arr("big", np.float32(-100))]
    nodes = [mk("Gather", ["table", "ids"], ["e"], axis=0), mk("Mul", ["e", "w"], ["m"]),
             mk("Tanh", ["m"], ["t"]), mk("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
             mk("Unsqueeze", ["mf", "ax"], ["mu"]), mk("Sub", ["one", "mu"], ["inv"]),
             mk("Mul", ["inv", "big"], ["neg"]), mk("Add", ["t", "neg"], ["y"])]
    inits.append(_arr("ax", np.array([-1], np.int64)))
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3]),
                          helper.make_tensor_value_info("mask", TensorProto.INT64, [1, 3])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4])], inits)


def test_ids_and_mask_run_as_one_program(tmp_path):
    engine, sess = _build(_ids_model(), tmp_path)
    program = engine._executor.program
    assert program is not None, engine._executor.program_blocked
    ctx = engine.create_context()
    feeds = [{"ids": np.array([[1, 2, 3]]), "mask": np.array([[1, 1, 0]])},
             {"ids": np.array([[9, 0, 4]]), "mask": np.array([[0, 1, 1]])},
             {"ids": np.array([[5, 5, 7]]), "mask": np.array([[1, 1, 1]])}]
    outs = []
    for f in feeds * 2:  # the first run traces, the others run the plan on other values
        got, want = ctx.run(f)["y"], sess.run(None, f)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        outs.append(got)
    assert not np.allclose(outs[0], outs[1])
    assert program.traced == 1 and not program.disabled
    assert [p for p in program.plans.values() if p]  # planned, not declined


def _reshape_by_input() -> onnx.ModelProto:
    """y = Reshape(Relu(x), shape): the int input's values set the output shape."""
    return _model([mk("Relu", ["x"], ["r"]), mk("Reshape", ["r", "shape"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                   helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


def _slice_by_input() -> onnx.ModelProto:
    """y = Sigmoid(x)[:, 0:k+1]: the int input reaches Slice's ends through an Add."""
    inits = [_arr("one", np.array([1], np.int64)), _arr("zero", np.array([0], np.int64)),
             _arr("ax", np.array([1], np.int64))]
    nodes = [mk("Sigmoid", ["x"], ["s"]), mk("Add", ["k", "one"], ["end"]),
             mk("Slice", ["s", "zero", "end", "ax"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                          helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


@pytest.mark.parametrize("case", ["reshape", "slice"])
def test_int_input_setting_a_shape_plans_per_value(case, tmp_path):
    """The program is keyed on the int input's values: one traced run per value, each value's
    plan keeps its own shapes (the third value is the first again: no new trace)."""
    engine, sess = _build(_reshape_by_input() if case == "reshape" else _slice_by_input(),
                          tmp_path)
    ex = engine._executor
    assert ex.program is not None and ex.program.keyed == (1,)
    assert ("Reshape" if case == "reshape" else "Slice") in ex.program_blocked
    name, values = ("shape", [[3, 4], [4, 3], [12, 1]]) if case == "reshape" else (
        "k", [[1], [4], [1]])
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    ctx, shapes = engine.create_context(), set()
    before = ex.program.traced  # (the build's tuning run may have traced one already)
    for v in values * 2:
        f = {"x": x, name: np.array(v, np.int64)}
        got, want = ctx.run(f)["y"], sess.run(None, f)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)
        shapes.add(got.shape)
    assert len(shapes) == (3 if case == "reshape" else 2)
    assert ex.program.traced - before == len({tuple(v) for v in values})
    assert not ex.program.disabled


def test_keyed_program_falls_back_when_values_keep_changing(tmp_path):
    from kiln.engine.program import _MAX_KEYED_TRACES

    engine, sess = _build(_slice_by_input(), tmp_path)
    ctx, program = engine.create_context(), engine._executor.program
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    program.plans.clear()
    program.traced = 0
    for k in range(_MAX_KEYED_TRACES + 3):
        f = {"x": x, "k": np.array([k], np.int64)}
        np.testing.assert_allclose(ctx.run(f)["y"], sess.run(None, f)[0], rtol=1e-6)
    assert program.disabled and program.traced == _MAX_KEYED_TRACES + 1


def _if_by_input() -> onnx.ModelProto:
    """y = x * 2 if n > 0 else x + 1: the int input sets the branch."""
    two, one = _arr("two", np.float32(2)), _arr("onef", np.float32(1))
    then = helper.make_graph([mk("Mul", ["x", "two"], ["a"])], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3])])
    other = helper.make_graph([mk("Add", ["x", "onef"], ["b"])], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])])
    nodes = [mk("Greater", ["n", "zero"], ["c"]),
             mk("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                          helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                  [two, one, _arr("zero", np.int64(0))])


def test_if_condition_from_an_int_input_plans_per_value(tmp_path):
    """Each value of n gets a plan with its branch inlined (no torch record: the If is gone)."""
    engine, sess = _build(_if_by_input(), tmp_path)
    ex = engine._executor
    assert ex.program is not None and ex.program.keyed == (1,) and "If" in ex.program_blocked
    ctx = engine.create_context()
    x = np.array([1.0, -2.0, 3.0], np.float32)
    for n in (1, -1, 5, 0, 1, -1):
        f = {"x": x, "n": np.array(n, np.int64)}
        np.testing.assert_allclose(ctx.run(f)["y"], sess.run(None, f)[0])
        np.testing.assert_allclose(ctx.run(f)["y"], x * 2 if n > 0 else x + 1)
    plans = [p for sig, p in ex.program.plans.items() if p and sig[-1][1][0] in (1, -1, 5, 0)]
    assert len(plans) == 4 and not any(p.fallbacks for p in plans)


def _branch_reshape_by_outer_constant() -> onnx.ModelProto:
    """y = Reshape(Relu(x), shape) if sum(x) > 0 else Reshape(Sigmoid(x), shape), ``shape`` an
    initializer of the outer graph that both branches capture."""
    out = [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)]
    then = helper.make_graph([mk("Relu", ["x"], ["a"]), mk("Reshape", ["a", "shape"], ["r"])],
                             "then", [], out)
    other = helper.make_graph([mk("Sigmoid", ["x"], ["b"]),
                               mk("Reshape", ["b", "shape"], ["r"])], "else", [], out)
    nodes = [mk("ReduceSum", ["x"], ["s"], keepdims=0), mk("Greater", ["s", "zero"], ["c"]),
             mk("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [_arr("shape", np.array([3, 4], np.int64)), _arr("zero", np.float32(0))])


def test_branch_capturing_an_outer_constant_runs_as_a_program(tmp_path):
    """A captured integer constant of the outer graph has the same value every run: the
    branches' executors run programs although it sets their Reshape's shape."""
    engine, sess = _build(_branch_reshape_by_outer_constant(), tmp_path)
    ifs = [st for st in engine._executor.steps if st.node.op.name == "If"]
    assert len(ifs) == 1
    branches = list(ifs[0].call.run_graph.execs.values())
    assert len(branches) == 2
    for ex in branches:
        assert any(c.name == "shape" for c in ex.graph.captures)
        assert ex.program is not None, ex.program_blocked
    ctx = engine.create_context()
    rng = np.random.default_rng(0)
    for sign in (1, -1, 1, -1):
        x = (np.abs(rng.standard_normal((2, 6))) * sign).astype(np.float32)
        got, want = ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0]
        assert got.shape == (3, 4)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _reshape_by_float_input() -> onnx.ModelProto:
    """y = Reshape(Relu(x), Cast<int64>(s * 1)): a float input's values, through arithmetic and
    a Cast, set the output shape."""
    nodes = [mk("Mul", ["s", "onef"], ["s1"]), mk("Cast", ["s1"], ["shape"], to=TensorProto.INT64),
             mk("Relu", ["x"], ["r"]), mk("Reshape", ["r", "shape"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                          helper.make_tensor_value_info("s", TensorProto.FLOAT, [2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [_arr("onef", np.float32(1))])


def _range_by_float_input() -> onnx.ModelProto:
    """y = Range(0, n, 1) * 2: a float input is Range's limit."""
    nodes = [mk("Range", ["zero", "n", "one"], ["r"]), mk("Mul", ["r", "two"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("n", TensorProto.FLOAT, [])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [_arr("zero", np.float32(0)), _arr("one", np.float32(1)),
                   _arr("two", np.float32(2))])


@pytest.mark.parametrize("case", ["reshape", "range"])
def test_float_input_setting_a_shape_keeps_the_python_loop(case, tmp_path):
    engine, sess = _build(_reshape_by_float_input() if case == "reshape"
                          else _range_by_float_input(), tmp_path)
    ex = engine._executor
    assert ex.program is None
    assert ("(Reshape) input 1, from 's'" if case == "reshape" else
            "(Range) input 1, from 'n'") in ex.program_blocked
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    feeds = ([{"x": x, "s": np.array(v, np.float32)} for v in ([3, 4], [4, 3], [12, 1])]
             if case == "reshape" else [{"n": np.array(v, np.float32)} for v in (3, 5, 3)])
    ctx, shapes = engine.create_context(), set()
    for f in feeds:
        got, want = ctx.run(f)["y"], sess.run(None, f)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)
        shapes.add(got.shape)
    assert len(shapes) == 2 if case == "range" else 3


def _argmax_gather() -> onnx.ModelProto:
    """y = table[argmax(x, 1)] + x[:, :4]: float data turned into indices that reach plain data
    only (Gather indices), a Cast of a float in the arithmetic."""
    rng = np.random.default_rng(1)
    nodes = [mk("ArgMax", ["x"], ["i"], axis=1, keepdims=0), mk("Gather", ["table", "i"], ["e"]),
             mk("Cast", ["x"], ["xi"], to=TensorProto.INT64),
             mk("Cast", ["xi"], ["xf"], to=TensorProto.FLOAT),
             mk("Slice", ["xf", "zero", "four", "ax"], ["xs"]), mk("Add", ["e", "xs"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                  [_arr("table", rng.standard_normal((6, 4)).astype(np.float32)),
                   _arr("zero", np.array([0], np.int64)), _arr("four", np.array([4], np.int64)),
                   _arr("ax", np.array([1], np.int64))])


def test_float_input_cast_to_indices_runs_as_a_program(tmp_path):
    engine, sess = _build(_argmax_gather(), tmp_path)
    program = engine._executor.program
    assert program is not None, engine._executor.program_blocked
    ctx, rng, outs = engine.create_context(), np.random.default_rng(2), []
    for _ in range(4):
        f = {"x": (3 * rng.standard_normal((2, 6))).astype(np.float32)}
        got, want = ctx.run(f)["y"], sess.run(None, f)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        outs.append(got)
    assert not np.allclose(outs[0], outs[1])
    assert program.traced == 1 and not program.disabled


def _ids_int8_model() -> onnx.ModelProto:
    """y = table[ids] through onnxruntime's dynamic quantization of a MatMul
    (DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul by the scales): ids whose values
    reach a quantized layer's activation, which is data."""
    rng = np.random.default_rng(1)
    inits = [_arr("table", rng.standard_normal((10, 8)).astype(np.float32)),
             _arr("w", rng.integers(-127, 128, (8, 5)).astype(np.int8)),
             _arr("wz", np.int8(0)), _arr("ws", np.float32(0.01))]
    nodes = [mk("Gather", ["table", "ids"], ["e"], axis=0),
             mk("DynamicQuantizeLinear", ["e"], ["q", "s", "z"]),
             mk("MatMulInteger", ["q", "w", "z", "wz"], ["acc"]),
             mk("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             mk("Mul", ["s", "ws"], ["sc"]), mk("Mul", ["accf", "sc"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 5])], inits)


def test_ids_into_a_quantized_matmul_run_as_one_program(tmp_path):
    engine, sess = _build(_ids_int8_model(), tmp_path)
    ex = engine._executor
    assert "Int8MatMul" in [st.node.op.name for st in ex.steps]
    assert ex.program is not None and ex.program_blocked is None, ex.program_blocked
    ctx = engine.create_context()
    for ids in ([[1, 2, 3]], [[9, 0, 4]], [[1, 2, 3]]):
        f = {"ids": np.array(ids)}
        np.testing.assert_allclose(ctx.run(f)["y"], sess.run(None, f)[0], rtol=1e-5, atol=1e-5)
    assert ex.program.traced == 1 and [p for p in ex.program.plans.values() if p]
