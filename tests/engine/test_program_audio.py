"""Native program records for the ops streaming audio models run between their recurrent
layers (kiln.engine.program_conv1d, kiln.engine.program_data): 1-D convolutions, reflect and
edge Pad, Gather by constant indices, Pow, ReduceMean/ReduceMax. Each single-node (or small)
model is checked against onnxruntime, and the plan is checked to hold no torch record for the
op (or one, where the planner must decline)."""

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


def _model(nodes, inputs: dict, inits: list, opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s)
                     for k, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(model, feeds: dict, tmp_path, want=None):
    """(kiln's output of a planned run, onnxruntime's (or ``want``), the plan's torch-record
    op counts)."""
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu", tf32=False)).build(str(path))
    ctx = engine.create_context()
    ctx.run(feeds)  # the traced run
    got = [ctx.run(feeds)["y"] for _ in range(2)]
    if want is None:
        want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            None, feeds)[0]
    plans = [p for p in engine._executor.program.plans.values() if p]
    assert len(plans) == 1
    assert got[0].shape == want.shape
    np.testing.assert_array_equal(got[0], got[1])  # the arena reused: the same result
    return got[0], want, Counter(fb.step.node.op.name for fb in plans[0].fallbacks)


def _close(got, want, tol=1e-5):
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tol * scale


def _w(rng, name, *shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


# ---- 1-D convolutions -------------------------------------------------------------------------

CONV1D = [  # (N, C, L, Co, K, attrs)
    (1, 1, 640, 258, 256, dict(strides=[128])),  # silero's STFT: taps overlap across rows
    (1, 129, 4, 128, 3, dict(pads=[1, 1])),
    (1, 128, 4, 64, 3, dict(pads=[1, 1], strides=[2])),
    (2, 16, 37, 24, 5, dict(pads=[2, 1], strides=[3])),  # rows of two items do not line up
    (2, 8, 30, 12, 3, dict(strides=[2])),  # they do: one GEMM over both items
    (1, 12, 40, 8, 3, dict(dilations=[2], pads=[2, 2])),
    (3, 12, 25, 16, 4, dict(dilations=[3], strides=[2], pads=[0, 3])),
    (1, 16, 20, 32, 3, dict(group=4, pads=[1, 1])),
    (2, 12, 19, 6, 1, dict(group=3)),
    (1, 8, 16, 8, 3, dict(auto_pad="SAME_UPPER", strides=[2])),
    (1, 8, 17, 8, 4, dict(auto_pad="SAME_LOWER")),
    (1, 4, 9, 5, 9, {}),  # the kernel covers the whole input: one output
]


@pytest.mark.parametrize("case", CONV1D, ids=[str(i) for i in range(len(CONV1D))])
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_matches_onnxruntime(case, bias, tmp_path):
    n, c, length, co, k, attrs = case
    rng = np.random.default_rng(len(attrs) + k)
    g = attrs.get("group", 1)
    inits = [_w(rng, "w", co, c // g, k)] + ([_w(rng, "b", co)] if bias else [])
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], **attrs)
    x = rng.standard_normal((n, c, length)).astype(np.float32)
    got, want, torch_ops = _run(_model([node], {"x": [n, c, length]}, inits), {"x": x},
                                tmp_path)
    _close(got, want)
    assert not torch_ops


@pytest.mark.parametrize("act", ["Relu", "Sigmoid", "Tanh", "LeakyRelu"])
def test_conv1d_fused_chain_matches_onnxruntime(act, tmp_path):
    """Conv + activation (a FusedConv), its channels-last result read by a second conv, a
    residual Add and a Transpose that hands the next conv a strided input."""
    rng = np.random.default_rng(3)
    inits = [_w(rng, "w1", 16, 8, 3), _w(rng, "b1", 16), _w(rng, "w2", 16, 16, 3),
             _w(rng, "b2", 16), _w(rng, "w3", 4, 16, 1)]
    mk = helper.make_node
    nodes = [mk("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1]), mk(act, ["c1"], ["a1"]),
             mk("Conv", ["a1", "w2", "b2"], ["c2"], pads=[1, 1]), mk("Add", ["c2", "a1"], ["s"]),
             mk("Relu", ["s"], ["r"]),
             mk("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
             mk("Transpose", ["t"], ["u"], perm=[0, 2, 1]),
             mk("Conv", ["u", "w3"], ["y"])]
    x = rng.standard_normal((2, 8, 21)).astype(np.float32)
    got, want, torch_ops = _run(_model(nodes, {"x": [2, 8, 21]}, inits), {"x": x}, tmp_path)
    _close(got, want)
    assert not torch_ops


def test_no_native_conv1d_past_max_groups(tmp_path):
    """A depthwise 1-D conv of many channels stays a torch record (and still matches)."""
    from kiln.engine.program_conv1d import MAX_GROUPS

    c = 2 * MAX_GROUPS
    rng = np.random.default_rng(4)
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=c, pads=[1, 1])
    x = rng.standard_normal((1, c, 10)).astype(np.float32)
    got, want, torch_ops = _run(_model([node], {"x": [1, c, 10]}, [_w(rng, "w", c, 1, 3)]),
                                {"x": x}, tmp_path)
    _close(got, want)
    assert torch_ops == Counter({"Conv": 1})


# ---- Pad --------------------------------------------------------------------------------------

PADS = [  # (shape, pads, axes or None)
    ((1, 576), [0, 64, 0, 64], None),  # silero's reflect: the last axis, both sides
    ((2, 3, 5), [0, 1, 2, 0, 2, 1], None),
    ((2, 4, 6, 7), [0, 0, 2, 3, 0, 0, 1, 3], None),
    ((3, 8), [2, 0], [1]),
    ((4, 5, 6), [1, 2, 3, 0], [-1, 0]),
]


@pytest.mark.parametrize("mode", ["reflect", "edge"])
@pytest.mark.parametrize("case", PADS, ids=[str(i) for i in range(len(PADS))])
def test_pad_modes_match_onnxruntime(mode, case, tmp_path):
    shape, pads, axes = case
    inits = [numpy_helper.from_array(np.array(pads, np.int64), "p")]
    ins = ["x", "p"]
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "a"))
        ins += ["", "a"]
    node = helper.make_node("Pad", ins, ["y"], mode=mode)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    got, want, torch_ops = _run(_model([node], {"x": list(shape)}, inits, opset=18), {"x": x},
                                tmp_path)
    np.testing.assert_array_equal(got, want)
    assert not torch_ops


def test_no_native_reflect_pad_wider_than_the_axis(tmp_path):
    """(onnxruntime refuses such a pad; NumPy reflects again, as kiln's torch kernel does)"""
    inits = [numpy_helper.from_array(np.array([0, 4, 0, 1], np.int64), "p")]
    node = helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect")
    x = np.random.default_rng(6).standard_normal((2, 3)).astype(np.float32)
    got, want, torch_ops = _run(_model([node], {"x": [2, 3]}, inits), {"x": x}, tmp_path,
                                want=np.pad(x, [(0, 0), (4, 1)], mode="reflect"))
    np.testing.assert_array_equal(got, want)
    assert torch_ops == Counter({"Pad": 1})


# ---- Gather, Pow, reductions ------------------------------------------------------------------

@pytest.mark.parametrize("axis, idx", [(0, 1), (1, -1), (0, [1]), (2, [0, 2, 4]), (2, [5, 3, 1]),
                                       (1, [2, 0, 2]), (-1, [4, 4])])
def test_gather_constant_indices_matches_onnxruntime(axis, idx, tmp_path):
    inits = [numpy_helper.from_array(np.array(idx, np.int64), "i")]
    mk = helper.make_node
    nodes = [mk("Gather", ["x", "i"], ["g"], axis=axis), mk("Neg", ["g"], ["y"])]
    x = np.random.default_rng(7).standard_normal((3, 4, 6)).astype(np.float32)
    got, want, torch_ops = _run(_model(nodes, {"x": [3, 4, 6]}, inits), {"x": x}, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert not torch_ops


def test_gather_of_no_constant_index_plans_and_matches_onnxruntime(tmp_path):
    """Must not fire: a constant index tensor with no element (tv_ssdlite320's empty selection,
    folded) gives an empty result; the planner leaves it to torch (it indexed the first of
    no indices and stopped the run)."""
    inits = [numpy_helper.from_array(np.zeros((0,), np.int64), "i")]
    mk = helper.make_node
    nodes = [mk("Gather", ["x", "i"], ["g"], axis=1), mk("Neg", ["g"], ["y"])]
    x = np.random.default_rng(7).standard_normal((3, 4, 6)).astype(np.float32)
    got, want, _ = _run(_model(nodes, {"x": [3, 4, 6]}, inits), {"x": x}, tmp_path)
    assert got.shape == want.shape == (3, 0, 6)


@pytest.mark.parametrize("e", [2.0, 0.5, 1.0, -1.0, 3.0])
def test_pow_constant_exponent_matches_onnxruntime(e, tmp_path):
    inits = [numpy_helper.from_array(np.array(e, np.float32), "e")]
    node = helper.make_node("Pow", ["x", "e"], ["y"])
    x = np.random.default_rng(8).uniform(0.1, 2.0, (2, 5, 7)).astype(np.float32)
    got, want, torch_ops = _run(_model([node], {"x": [2, 5, 7]}, inits), {"x": x}, tmp_path)
    _close(got, want, 1e-6)
    assert torch_ops == (Counter({"Pow": 1}) if e == 3.0 else Counter())


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax"])
@pytest.mark.parametrize("axes, keep", [([2], 1), ([-1], 0), ([1, 2], 1), ([0, 2], 0),
                                        ([1], 0), (None, 1), ([0, 1, 2, 3], 0)])
def test_reduce_matches_onnxruntime(op, axes, keep, tmp_path):
    inits, ins = [], ["x"]
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "a"))
        ins.append("a")
    node = helper.make_node(op, ins, ["y"], keepdims=keep)
    x = np.random.default_rng(9).standard_normal((2, 3, 5, 4)).astype(np.float32)
    got, want, torch_ops = _run(_model([node], {"x": [2, 3, 5, 4]}, inits, opset=18), {"x": x},
                                tmp_path)
    _close(got, want)
    assert not torch_ops
