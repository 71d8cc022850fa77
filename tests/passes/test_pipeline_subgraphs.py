"""The pipeline runs every fusion inside If / Loop subgraphs too, as it does on the outer graph
(silero-vad's encoder is Conv + Relu inside an If on the sample rate)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import import_onnx
from kiln.passes.pipeline import optimize

F32 = TensorProto.FLOAT
rng = np.random.default_rng(0)
W = rng.standard_normal((8, 4, 3)).astype(np.float32) * 0.3
B = rng.standard_normal(8).astype(np.float32)


def _branch(name: str, act: str, also_raw: bool = False) -> onnx.GraphProto:
    """Conv1d(x, W, B) -> act inside a branch; W and B are captured outer weights.
    ``also_raw``: the conv's own result is a branch output too (then it must not fuse)."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], [f"{name}_c"], name=f"{name}_conv",
                              pads=[1, 1]),
             helper.make_node(act, [f"{name}_c"], [f"{name}_y"], name=f"{name}_act")]
    outs = [f"{name}_y"] + ([f"{name}_c"] if also_raw else [])
    return helper.make_graph(nodes, name, [],
                             [helper.make_tensor_value_info(o, F32, None) for o in outs])


def _model(also_raw: bool = False) -> onnx.ModelProto:
    node = helper.make_node("If", ["cond"], ["y"] + (["c"] if also_raw else []), name="if",
                            then_branch=_branch("then", "Relu", also_raw),
                            else_branch=_branch("else", "Sigmoid", also_raw))
    g = helper.make_graph(
        [node], "t",
        [helper.make_tensor_value_info("x", F32, [1, 4, 16]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(o, F32, None) for o in ["y"] + (["c"] if also_raw
                                                                         else [])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _branches(g):
    node = next(n for n in g.nodes if n.op.name == "If")
    return node.attrs.then_branch, node.attrs.else_branch


def test_fuse_in_subgraph_structure_and_counts():
    g = import_onnx(_model())
    logs: list[str] = []
    optimize(g, logs.append)
    then, other = _branches(g)
    assert then.op_counts() == {"FusedConv": 1} and other.op_counts() == {"FusedConv": 1}
    assert then.nodes[0].attrs.activation == "Relu"
    assert other.nodes[0].attrs.activation == "Sigmoid"
    assert then.nodes[0].name == "then_conv + then_act"
    assert any("then_conv + then_act" in m for m in logs)


def test_no_fuse_in_subgraph_conv_result_is_branch_output():
    g = import_onnx(_model(also_raw=True))
    optimize(g)
    then, other = _branches(g)
    assert then.op_counts() == {"Conv": 1, "Relu": 1}
    assert other.op_counts() == {"Conv": 1, "Sigmoid": 1}


@pytest.mark.parametrize("also_raw", [False, True])
def test_fuse_in_subgraph_numerics(tmp_path, also_raw):
    model = _model(also_raw)
    path = tmp_path / "if_conv.onnx"
    onnx.save(model, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path)).create_context()
    x = rng.standard_normal((1, 4, 16)).astype(np.float32)
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        want = sess.run(None, feeds)
        got = ctx.run(feeds)
        for name, ref in zip(["y", "c"], want):
            np.testing.assert_allclose(np.asarray(got[name]), ref, rtol=1e-5, atol=1e-5)
