"""Native programs (kiln.engine.program): a CPU engine's steps run by kiln's C interpreter,
with torch records for the ops it has no planner for. Outputs match onnxruntime and the
executor's own Python loop; what runs natively and what as torch records is counted."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from bench.dispatch import chain_model
from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")


def _init(rng, name, *shape, scale=0.3):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _cnn() -> onnx.ModelProto:
    """conv 3x3 -> HardSwish -> Pad + depthwise 3x3 s2 (asymmetric) -> Relu -> max pool ->
    concat with an avg pool -> Softmax (a torch record) -> transpose -> reshape -> Mul by a
    broadcast constant -> Sigmoid."""
    rng = np.random.default_rng(0)
    inits = [_init(rng, "w1", 16, 3, 3, 3), _init(rng, "b1", 16), _init(rng, "w2", 16, 1, 3, 3),
             _init(rng, "b2", 16), _init(rng, "s", 32),
             numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), "pads"),
             numpy_helper.from_array(np.array([1, -1, 32], np.int64), "shape")]
    mk = helper.make_node
    nodes = [
        mk("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        mk("HardSwish", ["c1"], ["h1"], name="hs1"),
        mk("Pad", ["h1", "pads"], ["p1"], name="pad"),
        mk("Conv", ["p1", "w2", "b2"], ["c2"], group=16, strides=[2, 2], name="dw"),
        mk("Relu", ["c2"], ["r2"], name="relu2"),
        mk("MaxPool", ["r2"], ["m"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="maxpool"),
        mk("AveragePool", ["r2"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="avgpool"),
        mk("Concat", ["m", "a"], ["cat"], axis=1, name="concat"),
        mk("Softmax", ["cat"], ["sm"], axis=1, name="softmax"),
        mk("Transpose", ["sm"], ["t"], perm=[0, 2, 3, 1], name="transpose"),
        mk("Reshape", ["t", "shape"], ["rs"], name="reshape"),
        mk("Mul", ["rs", "s"], ["ms"], name="mul"),
        mk("Sigmoid", ["ms"], ["y"], name="sigmoid"),
    ]
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 12, 12])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _build(model, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    return engine, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _plan(program):
    plans = [p for p in program.plans.values() if p]
    assert len(plans) == 1
    return plans[0]


def _err(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("model", ["cnn", "chain"])
def test_program_matches_onnxruntime_and_the_python_loop(model, tmp_path):
    m = _cnn() if model == "cnn" else chain_model(60, (1, 8, 4, 4))
    engine, sess = _build(m, tmp_path)
    shape = (1, 3, 12, 12) if model == "cnn" else (1, 8, 4, 4)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ctx = engine.create_context()
    out = engine.outputs[0].name
    traced = ctx.run({"x": x})[out]  # the first run of a signature is the traced one
    got = [ctx.run({"x": x})[out] for _ in range(3)]
    want = sess.run(None, {"x": x})[0]
    program = engine._executor.program
    assert program.traced == 1
    for g in [traced, *got]:
        assert _err(g, want) <= 1e-5
    engine._executor.program = None  # the Python loop, for the same engine
    assert _err(ctx.run({"x": x})[out], got[0]) <= 1e-5
    plan = _plan(program)
    torch_ops = Counter(fb.step.node.op.name for fb in plan.fallbacks)
    if model == "chain":
        assert not torch_ops  # every layer a native record
    else:
        assert set(torch_ops) <= {"Softmax", "FusedConv"}, torch_ops  # FusedConv: oneDNN picks
        assert torch_ops["Softmax"] == 1


def test_program_plans_per_signature(tmp_path):
    m = chain_model(20, ("n", 4))  # a dynamic batch
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "n"
    engine, sess = _build(m, tmp_path)
    ctx = engine.create_context()
    for n in (1, 3, 1, 3):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        assert _err(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0]) <= 1e-5
    assert engine._executor.program.traced == 2


def test_program_outputs_are_fresh_tensors(tmp_path):
    """An output is never the arena's memory: a later run does not change an earlier result."""
    engine, _ = _build(chain_model(10, (1, 4)), tmp_path)
    ctx = engine.create_context()
    x = np.ones((1, 4), np.float32)
    ctx.run({"x": x})
    first = ctx.run({"x": x})["y"]
    keep = first.copy()
    ctx.run({"x": -x})
    assert np.array_equal(first, keep)


def test_torch_record_reads_views_of_torch_results_and_constants(tmp_path):
    """Softmax (a torch record) -> Reshape (a view, no record) -> Softmax: the second torch
    record gets a tensor viewing the first one's result; likewise for a reshaped constant."""
    rng = np.random.default_rng(0)
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.array([2, 12], np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal((3, 8)).astype(np.float32), "c"),
             numpy_helper.from_array(np.array([2, 12], np.int64), "shape2")]
    nodes = [mk("Softmax", ["x"], ["s1"], axis=-1), mk("Reshape", ["s1", "shape"], ["r"]),
             mk("Softmax", ["r"], ["s2"], axis=-1), mk("Reshape", ["c", "shape2"], ["rc"]),
             mk("Erf", ["rc"], ["e"]), mk("Add", ["s2", "e"], ["y"])]
    g = helper.make_graph(nodes, "views", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, 6])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 12])], inits)
    engine, sess = _build(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
                          tmp_path)
    ctx = engine.create_context()
    x = rng.standard_normal((4, 6)).astype(np.float32)
    for _ in range(3):
        assert _err(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0]) <= 1e-5


def test_plan_of_large_layers_runs_on_the_python_loop(tmp_path, monkeypatch):
    """Layers of 2^18 elements, above a threshold of 2^17 (the default is 2^24: a test that
    large would need gigabytes): the plan is declined (False) and the executor's loop runs the
    signature, with the same outputs."""
    from kiln.engine import program

    monkeypatch.setattr(program, "MAX_MEAN_WORK", 1 << 17)
    engine, sess = _build(chain_model(6, (1, 16, 128, 128)), tmp_path)
    ctx = engine.create_context()
    x = np.random.default_rng(0).standard_normal((1, 16, 128, 128)).astype(np.float32)
    for _ in range(2):
        assert _err(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0]) <= 1e-5
    assert list(engine._executor.program.plans.values()) == [False]


def _se_split(gate: str) -> onnx.ModelProto:
    """conv -> squeeze-excite (mean, 1x1 conv, Relu, 1x1 conv, gate, Mul) -> a channel split by
    two Slices (one from a negative start, one strided over W) -> Concat in swapped order; a
    Split of uneven parts, concatenated swapped."""
    rng = np.random.default_rng(0)
    ints = {name: numpy_helper.from_array(np.array(v, np.int64), name) for name, v in [
        ("s0", [0]), ("e0", [8]), ("s1", [-8]), ("e1", [1 << 30]), ("ax1", [1]),
        ("s2", [0, 1]), ("e2", [8, 1 << 30]), ("ax2", [1, 3]), ("st2", [1, 2]),
        ("sp", [4, 12])]}
    inits = [_init(rng, "w", 16, 3, 3, 3), _init(rng, "b", 16), _init(rng, "f1", 4, 16, 1, 1),
             _init(rng, "g1", 4), _init(rng, "f2", 16, 4, 1, 1), _init(rng, "g2", 16),
             *ints.values()]
    mk = helper.make_node
    gate_node = (mk("HardSigmoid", ["z"], ["gate"], alpha=1 / 6, beta=0.5) if gate == "hard"
                 else mk("Sigmoid", ["z"], ["gate"]))
    nodes = [
        mk("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        mk("GlobalAveragePool", ["c"], ["p"]),
        mk("Conv", ["p", "f1", "g1"], ["q"]),
        mk("Relu", ["q"], ["r"]),
        mk("Conv", ["r", "f2", "g2"], ["z"]),
        gate_node,
        mk("Mul", ["c", "gate"], ["se"]),
        mk("Slice", ["se", "s0", "e0", "ax1"], ["lo"]),
        mk("Slice", ["se", "s1", "e1", "ax1"], ["hi"]),
        mk("Slice", ["se", "s2", "e2", "ax2", "st2"], ["odd"]),
        mk("Concat", ["hi", "lo"], ["cat"], axis=1),
        mk("Relu", ["odd"], ["y2"]),
        mk("Sigmoid", ["cat"], ["y"]),
        mk("Split", ["se", "sp"], ["p4", "p12"], axis=1),
        mk("Concat", ["p12", "p4"], ["y3"], axis=1),
    ]
    g = helper.make_graph(nodes, "se", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 10, 10])], [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y3", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("gate", ["hard", "sigmoid"])
def test_squeeze_excite_slices_and_splits_are_native(gate, tmp_path):
    engine, sess = _build(_se_split(gate), tmp_path)
    assert any(r["op"] == "SqueezeExcite" for r in engine.layers())
    x = np.random.default_rng(1).standard_normal((1, 3, 10, 10)).astype(np.float32)
    ctx = engine.create_context()
    ctx.run({"x": x})  # traced
    got = ctx.run({"x": x})
    want = dict(zip(["y", "y2", "y3"], sess.run(None, {"x": x})))
    for k in want:
        assert _err(got[k], want[k]) <= 1e-5, k
    torch_ops = Counter(fb.step.node.op.name for fb in _plan(engine._executor.program).fallbacks)
    assert not {"SqueezeExcite", "Slice", "Split"} & set(torch_ops), torch_ops


def _shape_arith() -> onnx.ModelProto:
    """A dynamic batch, as timm's MobileViT export writes it: y = Reshape(Sigmoid(x),
    Concat(Unsqueeze(Gather(Shape(Relu(x)), 0) * 4), [-1, 3])); n = Shape(NonZero(x > 0))
    (depends on the values: never folded)."""
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0"),
             numpy_helper.from_array(np.array([-1, 3], np.int64), "minus1"),
             numpy_helper.from_array(np.array(4, np.int64), "four"),
             numpy_helper.from_array(np.array(0.0, np.float32), "fzero")]
    nodes = [mk("Relu", ["x"], ["r"]),
             mk("Shape", ["r"], ["s"]),
             mk("Gather", ["s", "zero"], ["b"], axis=0),
             mk("Mul", ["b", "four"], ["b4"]),
             mk("Unsqueeze", ["b4", "ax0"], ["b1"]),
             mk("Concat", ["b1", "minus1"], ["shape"], axis=0),
             mk("Sigmoid", ["x"], ["t"]),
             mk("Reshape", ["t", "shape"], ["y"]),
             mk("Greater", ["x", "fzero"], ["pos"]),
             mk("NonZero", ["pos"], ["nz"]),
             mk("Shape", ["nz"], ["n"])]
    g = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", 4, 3, 3])], [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("n", TensorProto.INT64, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_shape_arithmetic_is_folded_per_signature(tmp_path):
    engine, sess = _build(_shape_arith(), tmp_path)
    ctx = engine.create_context()
    rng = np.random.default_rng(2)
    for batch in (1, 3, 1):
        for _ in range(3):  # the traced run, then the planned ones on other values
            x = rng.standard_normal((batch, 4, 3, 3)).astype(np.float32)
            got = ctx.run({"x": x})
            want = dict(zip(["y", "n"], sess.run(None, {"x": x})))
            np.testing.assert_array_equal(got["n"], want["n"])
            np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6)
    program = engine._executor.program
    plans = [p for p in program.plans.values() if p]
    assert len(plans) == 2
    for plan in plans:
        torch_ops = Counter(fb.step.node.op.name for fb in plan.fallbacks)
        assert "Concat" not in torch_ops and "Gather" not in torch_ops, torch_ops
        assert torch_ops["NonZero"] == 1 and torch_ops["Shape"] == 1, torch_ops  # of NonZero's
        assert plan.folded


def test_pointwise_records_walk_the_output_contiguous_dim_innermost():
    """A channels-last [N, C, H, W] value is walked as [N, H, W, C] rows (whole vectors of
    channels), a broadcast [N, C, 1, 1] gate along them; a contiguous one keeps its order."""
    from kiln.engine.program import channels_last_strides, contiguous_strides
    from kiln.engine.program_ops import _collapse

    shape = (1, 24, 3, 5)
    cl = list(channels_last_strides(shape))
    gate = [24, 1, 0, 0]  # [1, 24, 1, 1] broadcast over H and W
    dims, strides = _collapse(shape, [cl, cl, gate])
    assert dims == [15, 24] and strides == [[24, 1], [24, 1], [0, 1]]
    dims, strides = _collapse(shape, [list(contiguous_strides(shape))] * 2)
    assert dims == [360] and strides == [[1], [1]]


def _stem(pads) -> onnx.ModelProto:
    """A network's stem: conv 3x3 stride 2 on 3 channels (pads per side) -> HardSwish."""
    rng = np.random.default_rng(3)
    mk = helper.make_node
    nodes = [mk("Conv", ["x", "w", "b"], ["c"], pads=pads, strides=[2, 2], name="stem"),
             mk("HardSwish", ["c"], ["y"], name="hs")]
    g = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 17, 18])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [_init(rng, "w", 16, 3, 3, 3), _init(rng, "b", 16)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("pads", [[1, 1, 1, 1], [0, 0, 1, 1]], ids=["symmetric", "tf_same"])
def test_stem_conv_is_a_native_record(pads, tmp_path, monkeypatch):
    from kiln.kernels.torch import fused_conv as FCK

    monkeypatch.setattr(FCK, "_FORCED_CONV", "kiln")  # (asymmetric pads: kiln's alone anyway)
    engine, sess = _build(_stem(pads), tmp_path)
    x = np.random.default_rng(4).standard_normal((1, 3, 17, 18)).astype(np.float32)
    ctx = engine.create_context()
    ctx.run({"x": x})  # traced
    got = ctx.run({"x": x})["y"]
    assert _err(got, sess.run(None, {"x": x})[0]) <= 1e-5
    plan = _plan(engine._executor.program)
    # the input copied channels-last (a pointwise record), kiln's direct conv, the output
    # copied out of the arena
    from kiln.engine.program_ops import OP_CONV, OP_PW

    assert not plan.fallbacks and plan.n == 34 + 26 + 34
    assert (plan.prog[0], plan.prog[34], plan.prog[60]) == (OP_PW, OP_CONV, OP_PW)
