"""Reductions and losses: single-node models against onnx.reference, plus shape rules."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kiln.errors import KilnError
from kiln.frontend.convert import import_onnx
from kiln.ir.types import sym
from tests.ops.harness import check_against_reference, node_model, run_kiln

REDUCE = ["ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]
RNG = np.random.default_rng(0)


@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_axes_input(op, keepdims):
    x = RNG.uniform(0.5, 2.0, (2, 3, 4)).astype(np.float32)
    axes = np.array([0, -1], np.int64)
    model = node_model(op, {"x": x, "axes": axes}, keepdims=keepdims)
    check_against_reference(model, {"x": x, "axes": axes})


@pytest.mark.parametrize("op", REDUCE)
def test_reduce_axes_attribute_old_opset(op):
    x = RNG.uniform(0.5, 2.0, (2, 3, 4)).astype(np.float32)
    model = node_model(op, {"x": x}, opset=11, axes=[1], keepdims=1)
    check_against_reference(model, {"x": x})


@pytest.mark.parametrize("op", REDUCE)
def test_reduce_all_axes_default(op):
    x = RNG.uniform(0.5, 2.0, (3, 4)).astype(np.float32)
    check_against_reference(node_model(op, {"x": x}, keepdims=0), {"x": x})


@pytest.mark.parametrize("op,expect", [("ReduceMax", -np.inf), ("ReduceMin", np.inf),
                                       ("ReduceProd", 1.0), ("ReduceSum", 0.0),
                                       ("ReduceLogSum", -np.inf),
                                       ("ReduceLogSumExp", -np.inf)])
def test_reduce_empty_set(op, expect):
    x = np.zeros((2, 0, 4), np.float32)
    axes = np.array([1], np.int64)
    (y,) = run_kiln(node_model(op, {"x": x, "axes": axes}, keepdims=1), {"x": x, "axes": axes})
    assert y.shape == (2, 1, 4) and y.dtype == np.float32
    np.testing.assert_array_equal(y, np.full((2, 1, 4), expect, np.float32))


def test_reduce_noop_with_empty_axes():
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    axes = np.zeros((0,), np.int64)
    model = node_model("ReduceSumSquare", {"x": x, "axes": axes}, noop_with_empty_axes=1)
    check_against_reference(model, {"x": x, "axes": axes})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_reduce_max_min_int_bool(dtype):
    x = RNG.integers(0, 2 if dtype == np.bool_ else 50, (3, 4)).astype(dtype)
    for op in ("ReduceMax", "ReduceMin"):
        check_against_reference(node_model(op, {"x": x}, keepdims=0), {"x": x})


def test_reduce_mean_int_keeps_dtype():
    x = np.array([[1, 2], [4, 7]], np.int32)
    (y,) = run_kiln(node_model("ReduceMean", {"x": x}, keepdims=0), {"x": x})
    assert y.dtype == np.int32


def test_reduce_bad_axis_raises():
    x = np.zeros((2, 3), np.float32)
    axes = np.array([5], np.int64)
    with pytest.raises(KilnError):
        run_kiln(node_model("ReduceSum", {"x": x, "axes": axes}), {"x": x, "axes": axes})


def test_reduce_symbolic_shape_rule():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [-1])
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [axes]),
                              opset_imports=[helper.make_opsetid("", 18)])
    g = import_onnx(model)
    assert g.outputs[0].type.shape == (sym("batch"), sym("seq"), 1)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_loss(reduction):
    x = RNG.standard_normal((3, 5, 2)).astype(np.float32)
    t = np.array([[1, 4], [0, -1], [2, 3]], np.int64)
    w = RNG.uniform(0.1, 1, 5).astype(np.float32)
    model = node_model("NegativeLogLikelihoodLoss", {"x": x, "t": t, "w": w},
                       reduction=reduction, ignore_index=-1)
    check_against_reference(model, {"x": x, "t": t, "w": w})


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softmax_cross_entropy(reduction):
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    t = np.array([1, 5, 0, 2], np.int64)
    model = node_model("SoftmaxCrossEntropyLoss", {"x": x, "t": t}, n_out=2,
                       reduction=reduction, ignore_index=5)
    check_against_reference(model, {"x": x, "t": t})
    g = import_onnx(model)
    expect = (4,) if reduction == "none" else ()
    assert g.outputs[0].type.shape == expect

