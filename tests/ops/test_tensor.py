"""Unit tests for the tensor manipulation / shape ops, against onnx's ReferenceEvaluator."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from kiln.errors import KilnError
from kiln.frontend import import_onnx
from tests.ops.harness import assert_close, check_against_reference, node_model, run_kiln

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4)).astype(np.float32)


def _i64(*v):
    return np.array(v, np.int64)


@pytest.mark.parametrize("op, inputs, attrs", [
    ("Reshape", {"x": X, "s": _i64(0, -1)}, {}),
    ("Reshape", {"x": X, "s": _i64(0, 4, 3)}, {}),
    ("Flatten", {"x": X}, {"axis": -1}),
    ("Transpose", {"x": X}, {"perm": [2, 0, 1]}),
    ("Squeeze", {"x": X[:1], "a": _i64(0)}, {}),
    ("Unsqueeze", {"x": X, "a": _i64(-1, 0)}, {}),
    ("Concat", {"x": X, "y": X[:, :1]}, {"axis": 1}),
    ("Slice", {"x": X, "s": _i64(-1, 1), "e": _i64(-10**9, 3), "a": _i64(2, 0),
               "p": _i64(-2, 1)}, {}),
    ("Gather", {"x": X, "i": _i64(-1, 0, 1).reshape(3, 1)}, {"axis": 1}),
    ("GatherElements", {"x": X, "i": RNG.integers(-3, 3, (2, 2, 4))}, {"axis": 1}),
    ("GatherND", {"x": X, "i": _i64(1, 2, 0, 0).reshape(2, 2)}, {}),
    # the leading axis (index_select): negative indices, several index dims, a 1-D x
    ("GatherND", {"x": X, "i": _i64(1, -2, 0, 1, 1, -1).reshape(2, 3, 1)}, {}),
    ("GatherND", {"x": X[0, 0], "i": _i64(3, 0, -4).reshape(3, 1)}, {}),
    ("GatherND", {"x": X, "i": np.zeros((0, 1), np.int64)}, {}),
    ("GatherND", {"x": X, "i": _i64(1, 0, 2, 1).reshape(2, 2, 1)}, {"batch_dims": 1}),
    ("ScatterElements", {"x": X, "i": _i64(0, 2).reshape(1, 1, 2),
                         "u": np.ones((1, 1, 2), np.float32)}, {"axis": 2, "reduction": "add"}),
    ("ScatterND", {"x": X, "i": _i64(1, 0, 1, 0).reshape(2, 2),
                   "u": np.ones((2, 4), np.float32)}, {"reduction": "mul"}),
    ("Expand", {"x": X[:, :1], "s": _i64(2, 1, 3, 1)}, {}),
    ("Tile", {"x": X, "r": _i64(1, 2, 2)}, {}),
    ("Pad", {"x": X, "p": _i64(0, 2, 1, 0, 3, 2)}, {"mode": "reflect"}),
    ("Pad", {"x": X, "p": _i64(0, 5, 1, 0, 1, 2)}, {"mode": "wrap"}),
    ("Pad", {"x": X, "p": _i64(0, 1, 2, 0, 1, 1), "v": np.array(7.0, np.float32)}, {}),
    ("TopK", {"x": X, "k": _i64(2)}, {"axis": 1, "largest": 0}),
    ("ArgMax", {"x": np.array([[1, 3, 3], [2, 2, 0]], np.int32)}, {"select_last_index": 1}),
    ("CumSum", {"x": X, "a": np.array(1, np.int32)}, {"exclusive": 1, "reverse": 1}),
    ("Trilu", {"x": X, "k": _i64(-1)}, {"upper": 0}),
    ("OneHot", {"i": _i64(0, -1, 5), "d": np.array(4, np.int64),
                "v": np.array([0, 2], np.float32)}, {"axis": 0}),
    ("Range", {"a": np.array(1.0, np.float32), "b": np.array(5.0, np.float32),
               "c": np.array(1.5, np.float32)}, {}),
    ("DepthToSpace", {"x": RNG.standard_normal((1, 8, 2, 3)).astype(np.float32)},
     {"blocksize": 2, "mode": "CRD"}),
    ("ReverseSequence", {"x": X, "l": _i64(3, 1)}, {"batch_axis": 0, "time_axis": 1}),
    ("CenterCropPad", {"x": X, "s": _i64(5, 2)}, {"axes": [1, 2]}),
])
def test_against_reference(op, inputs, attrs):
    n_out = 2 if op == "TopK" else 1
    check_against_reference(node_model(op, inputs, n_out=n_out, **attrs), inputs)


def test_split_uneven_and_unique():
    x = np.arange(7, dtype=np.float32)
    check_against_reference(node_model("Split", {"x": x}, n_out=3, num_outputs=3), {"x": x})
    u = np.array([2, 1, 1, 3, 4, 3], np.float32)
    check_against_reference(node_model("Unique", {"x": u}, n_out=4, sorted=0), {"x": u})


def test_old_opset_attributes():
    check = check_against_reference
    assert_close(run_kiln(node_model("Reshape", {"x": X}, opset=1, shape=[6, 4]), {"x": X})[0],
                 X.reshape(6, 4))
    check(node_model("Squeeze", {"x": X[:1]}, opset=11, axes=[0]), {"x": X[:1]})
    check(node_model("Split", {"x": X}, n_out=2, opset=11, axis=2, split=[1, 3]), {"x": X})
    check(node_model("Slice", {"x": X}, opset=9, starts=[1], ends=[3], axes=[1]), {"x": X})
    check(node_model("Pad", {"x": X}, opset=10, pads=[0, 1, 1, 0, 0, 1], value=2.0), {"x": X})


def test_negative_pads_crop():
    inputs = {"x": X, "p": _i64(0, -1, 2, 0, 1, -1)}
    got = run_kiln(node_model("Pad", inputs, mode="edge"), inputs)[0]
    assert_close(got, np.pad(X[:, 1:, :3], [(0, 0), (0, 1), (2, 0)], mode="edge"))


@pytest.mark.parametrize("op, extra, attrs", [
    ("Reshape", {"s": _i64(3, -1)}, {}),
    ("Transpose", {}, {}),
    ("Identity", {}, {}),
    ("Unsqueeze", {"a": _i64(0)}, {}),
    ("Slice", {"s": _i64(1), "e": _i64(10)}, {}),
    ("Gather", {"i": _i64(0, 2)}, {"axis": 1}),
    ("Expand", {"s": _i64(2, 2, 3)}, {}),
    ("Tile", {"r": _i64(2, 1)}, {}),
])
def test_strings_pass_through(op, extra, attrs):
    x = np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)
    inputs = {"x": x, **extra}
    check_against_reference(node_model(op, inputs, **attrs), inputs)


def test_int4_pass_through():
    x = np.arange(-4, 4).astype(ml_dtypes.int4).reshape(2, 4)
    model = node_model("Transpose", {"x": x})
    got = run_kiln(model, {"x": x})[0]
    assert got.dtype == x.dtype and np.array_equal(got.astype(np.int8), x.T.astype(np.int8))


def test_constant_forms():
    for kw, want in [({"value_int": 3}, np.array(3, np.int64)),
                     ({"value_floats": [1.0, 2.0]}, np.array([1, 2], np.float32)),
                     ({"value": numpy_helper.from_array(np.float32(2.5))}, np.float32(2.5))]:
        assert_close(run_kiln(node_model("Constant", {}, **kw), {})[0], want)


def test_dropout_inference_is_identity():
    model = node_model("Dropout", {"x": X}, n_out=2)
    y, mask = run_kiln(model, {"x": X})
    assert_close(y, X)
    assert mask.dtype == np.bool_ and mask.all()


def test_symbolic_shape_subgraph():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape keeps batch/seq symbolic."""
    h = helper
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Constant", [], ["i0"], value_int=0),
        h.make_node("Constant", [], ["i1"], value_int=1),
        h.make_node("Gather", ["s", "i0"], ["b"]),
        h.make_node("Gather", ["s", "i1"], ["t"]),
        h.make_node("Unsqueeze", ["b", "ax"], ["bu"]),
        h.make_node("Unsqueeze", ["t", "ax"], ["tu"]),
        h.make_node("Constant", [], ["c"], value_ints=[12, -1]),
        h.make_node("Concat", ["bu", "tu", "c"], ["shp"], axis=0),
        h.make_node("Reshape", ["x", "shp"], ["y"]),
        h.make_node("Transpose", ["y"], ["z"], perm=[0, 2, 1, 3]),
        h.make_node("Flatten", ["z"], ["f"], axis=2),
    ]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", 768])],
                     [h.make_tensor_value_info("f", TP.FLOAT, None)],
                     initializer=[numpy_helper.from_array(_i64(0), "ax")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    graph = import_onnx(model)
    types = {v.name: str(v.type) for n in graph.nodes for v in n.outputs}
    assert types["y"] == "float32[batch,seq,12,64]"
    assert types["z"] == "float32[batch,12,seq,64]"
    assert types["f"] == "float32[12*batch,64*seq]"
    x = RNG.standard_normal((2, 5, 768)).astype(np.float32)
    assert run_kiln(model, {"x": x})[0].shape == (24, 320)


def test_bad_reshape_raises():
    model = node_model("Reshape", {"x": X, "s": _i64(5, -1)})
    with pytest.raises(KilnError):
        run_kiln(model, {"x": X, "s": _i64(5, -1)})


def test_gather_out_of_range_raises():
    model = node_model("Gather", {"x": X, "i": _i64(7)})
    with pytest.raises(KilnError):
        run_kiln(model, {"x": X, "i": _i64(7)})



def test_slice_plans_follow_values_and_shapes():
    """Slice keeps the index it works out per (starts, ends, axes, steps, input shape): a node
    called with new values or a new shape slices by those."""
    import torch

    from kiln.kernels.registry import Call
    from kiln.kernels.torch.tensor import slice_

    call = Call(None, 1, 5)
    x = torch.arange(24.0).reshape(4, 6)
    t = torch.tensor
    np.testing.assert_array_equal(slice_(call, x, t([1]), t([3]), t([1])), x[:, 1:3])
    np.testing.assert_array_equal(slice_(call, x, t([2]), t([5]), t([1])), x[:, 2:5])
    y = torch.arange(40.0).reshape(4, 10)
    np.testing.assert_array_equal(slice_(call, y, t([2]), t([5]), t([1])), y[:, 2:5])
    np.testing.assert_array_equal(slice_(call, y, t([-1]), t([-100]), t([1]), t([-2])),
                                  y.numpy()[:, ::-2])


def test_gather_scalar_index_negative_and_out_of_range():
    import torch

    from kiln.kernels.registry import Call
    from kiln.kernels.torch.tensor import gather
    from kiln.ops import tensor as T

    x = torch.arange(12.0).reshape(3, 4)
    call = Call(T.Gather.make_attrs(axis=1), 1, 2)
    np.testing.assert_array_equal(gather(call, x, torch.tensor(-1)), x[:, 3])
    np.testing.assert_array_equal(gather(call, x, torch.tensor(2, dtype=torch.int32)), x[:, 2])
    with pytest.raises(IndexError, match="index 4 out of range"):
        gather(call, x, torch.tensor(4))


def test_gather_nd_leading_axis_rule():
    """GatherND takes index_select only for batch_dims 0 and one index per slice; the other
    forms (k = 2, batch_dims 1) keep the general path, checked against the reference above."""
    import torch

    from kiln.kernels.torch.tensor import leading_axis_rows
    assert leading_axis_rows(0, torch.zeros(5, 1))
    assert leading_axis_rows(0, torch.zeros(2, 3, 1))
    assert not leading_axis_rows(0, torch.zeros(5, 2))
    assert not leading_axis_rows(1, torch.zeros(2, 3, 1))


def test_gather_nd_leading_axis_out_of_range_names_the_node():
    model = node_model("GatherND", {"x": X, "i": _i64(0, 2).reshape(2, 1)})
    with pytest.raises(Exception, match=r"GatherND .*index 2 out of range .*size 2"):
        run_kiln(model, {"x": X, "i": _i64(0, 2).reshape(2, 1)})
