"""Elimination passes: no-ops, Transpose/Reshape chains, common subexpressions, dead nodes.
Each three ways (structure, counts, numerics) plus cases where it must not fire."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kiln.frontend import import_onnx
from kiln.passes import eliminate, fold, refine
from tests.passes.test_fold import assert_same_outputs, const, make_model, run, run_passes

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
NOOPS = [("remove_noops", eliminate.remove_noops),
         ("remove_dead_nodes", eliminate.remove_dead_nodes)]
ALL = eliminate.PASSES
rng = np.random.default_rng(1)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- no-ops


def noop_chain_model():
    nodes = [helper.make_node("Identity", ["x"], ["a"], name="ident"),
             helper.make_node("Dropout", ["a"], ["b"], name="drop"),
             helper.make_node("Cast", ["b"], ["c"], name="cast", to=F32),
             helper.make_node("Transpose", ["c"], ["d"], name="tr", perm=[0, 1]),
             const("pads", np.zeros(4, np.int64)),
             helper.make_node("Pad", ["d", "pads"], ["e"], name="pad"),
             const("st", np.array([0, 0])), const("en", np.array([2**62, 2**62])),
             helper.make_node("Slice", ["e", "st", "en"], ["f"], name="slice"),
             const("shape", np.array([3, 4])),
             helper.make_node("Expand", ["f", "shape"], ["g"], name="expand"),
             helper.make_node("Reshape", ["g", "shape"], ["h"], name="reshape"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    return make_model(nodes, [("x", F32, [3, 4])], ["y"])


def test_remove_noops_structure():
    g = import_onnx(noop_chain_model())
    run_passes(g, NOOPS)
    (relu,) = g.nodes
    assert relu.name == "relu" and relu.inputs[0] is g.inputs[0]


def test_remove_noops_counts():
    g = import_onnx(noop_chain_model())
    assert g.op_counts()["Identity"] == 1 and len(g.nodes) == 13
    run_passes(g, NOOPS)
    assert g.op_counts() == {"Relu": 1}  # the Constant nodes fed only the no-ops


def test_remove_noops_numerics():
    assert_same_outputs(noop_chain_model(), NOOPS, {"x": randn(3, 4)})


def test_remove_noops_graph_output_keeps_its_name():
    # Relu's value takes over the output name "y", so the engine's outputs do not change
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Identity", ["r"], ["y"], name="ident")]
    model = make_model(nodes, [("x", F32, [2, 3])], ["y"])
    g = import_onnx(model)
    run_passes(g, NOOPS)
    assert [n.name for n in g.nodes] == ["relu"]
    assert g.outputs[0] is g.nodes[0].outputs[0] and g.outputs[0].name == "y"
    assert_same_outputs(model, NOOPS, {"x": randn(2, 3)})


def test_no_fuse_identity_graph_input_to_output():
    # y = Identity(x): x's name is the input's, y's the output's; both must stay
    nodes = [helper.make_node("Identity", ["x"], ["y"], name="ident")]
    g = import_onnx(make_model(nodes, [("x", F32, [2])], ["y"]))
    run_passes(g, NOOPS)
    assert g.op_counts() == {"Identity": 1}


def test_no_fuse_dropout_training_mode():
    nodes = [const("ratio", np.float32(0.5)), const("train", np.bool_(True)),
             helper.make_node("Dropout", ["x", "ratio", "train"], ["d"], name="drop"),
             helper.make_node("Relu", ["d"], ["y"], name="relu")]
    g = import_onnx(make_model(nodes, [("x", F32, [2, 3])], ["y"]))
    run_passes(g, NOOPS)
    assert g.op_counts()["Dropout"] == 1


def test_no_fuse_dropout_mask_read():
    nodes = [helper.make_node("Dropout", ["x"], ["d", "mask"], name="drop"),
             helper.make_node("Cast", ["mask"], ["m"], name="cast", to=F32),
             helper.make_node("Add", ["d", "m"], ["y"], name="add")]
    g = import_onnx(make_model(nodes, [("x", F32, [2, 3])], ["y"]))
    run_passes(g, NOOPS)
    assert g.op_counts() == {"Add": 1, "Cast": 1, "Dropout": 1}


def test_no_fuse_cast_other_dtype():
    nodes = [helper.make_node("Cast", ["x"], ["y"], name="cast", to=I64)]
    g = import_onnx(make_model(nodes, [("x", F32, [2])], ["y"]))
    run_passes(g, NOOPS)
    assert g.op_counts() == {"Cast": 1}


def test_no_fuse_slice_reversed():
    # step -1 keeps the shape but not the contents
    nodes = [const("st", np.array([-1])), const("en", np.array([-2**62])),
             const("ax", np.array([0])), const("sp", np.array([-1])),
             helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["s"], name="slice"),
             helper.make_node("Relu", ["s"], ["y"], name="relu")]
    model = make_model(nodes, [("x", F32, [4])], ["y"])
    g = import_onnx(model)
    run_passes(g, NOOPS)
    assert g.op_counts()["Slice"] == 1
    assert_same_outputs(model, NOOPS, {"x": randn(4)})


def resize_model(scales=None, sizes=None, shape_sizes=False, out_hw=None, **attrs):
    """Relu(Resize(x [1, 3, 5, 6])) with constant scales or sizes, or (``shape_sizes``) sizes
    computed from x's own shape as torchvision's detection transform does, constant only once
    folding has run under the fixed dims."""
    nodes, ins = [], ["x", "", ""]
    if scales is not None:
        nodes.append(const("scales", np.asarray(scales, np.float32)))
        ins = ["x", "", "scales"]
    elif shape_sizes:
        nodes.append(helper.make_node("Shape", ["x"], ["sizes"], name="shape"))
        ins = ["x", "", "", "sizes"]
    else:
        nodes.append(const("sizes", np.asarray(sizes, np.int64)))
        ins = ["x", "", "", "sizes"]
    nodes += [helper.make_node("Resize", ins, ["r"], name="resize", **attrs),
              helper.make_node("Relu", ["r"], ["y"], name="relu")]
    return make_model(nodes, [("x", F32, [1, 3, 5, 6])], ["y"])


FOLD_AND_NOOPS = refine.PASSES + fold.PASSES + NOOPS


@pytest.mark.parametrize("kw", [
    {"scales": [1, 1, 1, 1], "mode": "linear"},
    {"sizes": [1, 3, 5, 6], "mode": "linear", "coordinate_transformation_mode": "half_pixel"},
    {"sizes": [5, 6], "axes": [2, 3], "mode": "cubic",
     "coordinate_transformation_mode": "align_corners"},
    {"shape_sizes": True, "mode": "linear"},
    {"scales": [1, 1, 1, 1], "mode": "nearest",
     "coordinate_transformation_mode": "tf_half_pixel_for_nn"},
])
def test_remove_identity_resize_structure_counts_numerics(kw):
    model = resize_model(**kw)
    g = import_onnx(model)
    assert g.op_counts()["Resize"] == 1
    logs = run_passes(g, FOLD_AND_NOOPS)
    assert g.op_counts() == {"Relu": 1}
    (relu,) = g.nodes
    assert relu.inputs[0] is g.inputs[0]
    assert any("resize" in m and "no-op" in m for m in logs)
    assert_same_outputs(model, FOLD_AND_NOOPS, {"x": randn(1, 3, 5, 6)})


@pytest.mark.parametrize("kw", [
    {"scales": [1, 1, 2, 2], "mode": "linear"},  # a real upscale
    {"sizes": [1, 3, 10, 12], "mode": "nearest"},
    {"sizes": [5, 7], "axes": [2, 3], "mode": "linear"},
    {"scales": [1, 1, 1.1, 1.1], "mode": "linear"},  # floor(5.5) = 5: the shape stays, not the
                                                     # samples
    {"scales": [1, 1, 1, 1], "mode": "linear",
     "coordinate_transformation_mode": "tf_crop_and_resize"},  # the roi moves the samples
    {"scales": [1, 1, 1, 1], "mode": "nearest", "nearest_mode": "round_prefer_ceil",
     "coordinate_transformation_mode": "tf_half_pixel_for_nn"},  # x + 0.5 rounded up
])
def test_no_fuse_resize_that_resamples(kw):
    model = resize_model(**kw)
    g = import_onnx(model)
    run_passes(g, FOLD_AND_NOOPS)
    assert g.op_counts()["Resize"] == 1


def test_no_fuse_resize_sizes_known_at_run_time():
    # sizes a graph input: the output shape may be anything
    nodes = [helper.make_node("Resize", ["x", "", "", "s"], ["y"], name="resize")]
    g = import_onnx(make_model(nodes, [("x", F32, [1, 3, 5, 6]), ("s", I64, [4])], ["y"]))
    run_passes(g, FOLD_AND_NOOPS)
    assert g.op_counts() == {"Resize": 1}


# ---------------------------------------------------------------- Transpose / Reshape chains


def transpose_pair_model(p1, p2):
    nodes = [helper.make_node("Transpose", ["x"], ["t"], name="t1", perm=p1),
             helper.make_node("Transpose", ["t"], ["u"], name="t2", perm=p2),
             helper.make_node("Relu", ["u"], ["y"], name="relu")]
    return make_model(nodes, [("x", F32, [2, 3, 4])], ["y"])


def test_merge_transposes_structure():
    g = import_onnx(transpose_pair_model([1, 0, 2], [0, 2, 1]))
    run_passes(g, ALL)
    tr, relu = g.nodes
    assert tr.name == "t1 + t2" and tr.inputs[0] is g.inputs[0]
    assert tuple(tr.attrs.perm) == (1, 2, 0)  # q[i] = p1[p2[i]]
    assert relu.inputs[0] is tr.outputs[0]


@pytest.mark.parametrize("p1,p2,left", [([1, 0, 2], [0, 2, 1], 1), ([0, 2, 1], [0, 2, 1], 0),
                                        ([2, 0, 1], [1, 2, 0], 0)])
def test_merge_transposes_counts_and_numerics(p1, p2, left):
    model = transpose_pair_model(p1, p2)
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts().get("Transpose", 0) == left
    assert_same_outputs(model, ALL, {"x": randn(2, 3, 4)})


def test_no_fuse_transpose_pair_unknown_rank():
    # the default perm reverses the axes: without a rank there is nothing to compose
    nodes = [helper.make_node("Transpose", ["x"], ["t"], name="t1"),
             helper.make_node("Transpose", ["t"], ["y"], name="t2")]
    g = import_onnx(make_model(nodes, [("x", F32, None)], ["y"]))
    run_passes(g, ALL)
    assert g.op_counts() == {"Transpose": 2}


def reshape_pair_model(s2):
    nodes = [const("s1", np.array([6, 4])), const("s2", np.array(s2)),
             helper.make_node("Reshape", ["x", "s1"], ["r"], name="r1"),
             helper.make_node("Reshape", ["r", "s2"], ["u"], name="r2"),
             helper.make_node("Relu", ["u"], ["y"], name="relu")]
    return make_model(nodes, [("x", F32, [2, 3, 4])], ["y"])


def test_merge_reshapes_structure_counts_numerics():
    model = reshape_pair_model([3, -1])
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"Constant": 1, "Relu": 1, "Reshape": 1}
    r = next(n for n in g.nodes if n.op.name == "Reshape")
    assert r.name == "r1 + r2" and r.inputs[0] is g.inputs[0]
    assert_same_outputs(model, ALL, {"x": randn(2, 3, 4)})


def test_no_fuse_reshape_pair_copy_dim():
    # the 0 in [0, 2, -1] copies dim 0 of the intermediate (6), not of x (2)
    model = reshape_pair_model([0, 2, -1])
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts()["Reshape"] == 2
    assert_same_outputs(model, ALL, {"x": randn(2, 3, 4)})


# ---------------------------------------------------------------- common subexpressions


def cse_model():
    nodes = [helper.make_node("Relu", ["x"], ["r1"], name="relu1"),
             helper.make_node("Relu", ["x"], ["r2"], name="relu2"),
             const("c1", np.float32(2.0)), const("c2", np.float32(2.0)),
             helper.make_node("Mul", ["r1", "c1"], ["m1"], name="mul1"),
             helper.make_node("Mul", ["r2", "c2"], ["m2"], name="mul2"),
             helper.make_node("Add", ["m1", "m2"], ["y"], name="add")]
    return make_model(nodes, [("x", F32, [3])], ["y"])


def test_merge_common_nodes_structure():
    g = import_onnx(cse_model())
    run_passes(g, ALL)
    names = [n.name for n in g.nodes]
    assert names[0] == "relu1" and names[2:] == ["mul1", "add"]
    assert g.nodes[1].outputs[0].name == "c1"
    add = g.nodes[-1]
    assert add.inputs[0] is add.inputs[1] is g.nodes[2].outputs[0]


def test_merge_common_nodes_counts_numerics():
    g = import_onnx(cse_model())
    assert g.op_counts() == {"Add": 1, "Constant": 2, "Mul": 2, "Relu": 2}
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1, "Constant": 1, "Mul": 1, "Relu": 1}
    assert_same_outputs(cse_model(), ALL, {"x": randn(3)})


def test_merge_common_nodes_by_symbolic_value():
    # Shape(a)[1] and Shape(b)[1] are both "seq": one chain is enough
    nodes = [helper.make_node("Shape", ["a"], ["sa"], name="shape_a"),
             helper.make_node("Shape", ["b"], ["sb"], name="shape_b"),
             const("i", np.array([1])),
             helper.make_node("Gather", ["sa", "i"], ["da"], name="ga"),
             helper.make_node("Gather", ["sb", "i"], ["db"], name="gb"),
             helper.make_node("Add", ["da", "db"], ["y"], name="add")]
    model = make_model(nodes, [("a", F32, ["batch", "seq"]), ("b", F32, ["seq", "seq"])], ["y"])
    g = import_onnx(model)
    run_passes(g, ALL)
    assert g.op_counts() == {"Add": 1, "Constant": 1, "Gather": 1, "Shape": 1}
    feeds = {"a": randn(2, 5), "b": randn(5, 5)}
    assert_same_outputs(model, ALL, feeds)


def test_no_fuse_cse_random():
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["r1"], name="rand1"),
             helper.make_node("RandomNormalLike", ["x"], ["r2"], name="rand2"),
             helper.make_node("Sub", ["r1", "r2"], ["y"], name="sub")]
    g = import_onnx(make_model(nodes, [("x", F32, [8])], ["y"]))
    run_passes(g, ALL)
    assert g.op_counts() == {"RandomNormalLike": 2, "Sub": 1}
    assert np.abs(run(g, {"x": randn(8)})[0]).max() > 0


def test_no_fuse_cse_different_attrs_or_outputs():
    nodes = [helper.make_node("Transpose", ["x"], ["y1"], name="t1", perm=[1, 0]),
             helper.make_node("Transpose", ["x"], ["y2"], name="t2", perm=[0, 1]),
             helper.make_node("Relu", ["x"], ["y3"], name="relu1"),
             helper.make_node("Relu", ["x"], ["y4"], name="relu2")]
    g = import_onnx(make_model(nodes, [("x", F32, [2, 2])], ["y1", "y2", "y3", "y4"]))
    run_passes(g, [("merge_common_nodes", eliminate.merge_common_nodes)])
    assert g.op_counts() == {"Relu": 2, "Transpose": 2}  # y3 and y4 are both named outputs


# ---------------------------------------------------------------- dead nodes


def test_remove_dead_nodes_structure_counts_numerics():
    w = randn(3, 3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["unused"], name="dead_mm"),
             helper.make_node("Relu", ["unused"], ["unused2"], name="dead_relu"),
             helper.make_node("Sigmoid", ["x"], ["y"], name="sig")]
    model = make_model(nodes, [("x", F32, [3, 3])], ["y"], [("w", w)])
    g = import_onnx(model)
    assert g.op_counts() == {"MatMul": 1, "Relu": 1, "Sigmoid": 1} and "w" in g.weights
    run_passes(g, [("remove_dead_nodes", eliminate.remove_dead_nodes)])
    assert [n.name for n in g.nodes] == ["sig"] and not g.weights
    assert_same_outputs(model, ALL, {"x": randn(3, 3)})


def test_no_fuse_dead_nodes_graph_outputs():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Neg", ["a"], ["b"], name="neg")]
    g = import_onnx(make_model(nodes, [("x", F32, [2])], ["a", "b"]))
    run_passes(g, [("remove_dead_nodes", eliminate.remove_dead_nodes)])
    assert g.op_counts() == {"Neg": 1, "Relu": 1}
