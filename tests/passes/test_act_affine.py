"""fuse_act_affine: FusedConv(HardSwish) -> Mul/Add by one-element constants -> one FusedConv
with the HardSwishAffine epilogue (CPU): structure, counts, numerics against onnxruntime (the
torch kernel and a built engine, whose convs run kiln's native kernels or oneDNN), where it
must not fire, and that the CUDA pipeline leaves it out."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.frontend import import_onnx
from kiln.ops import fused_conv as FC
from kiln.passes.pipeline import optimize
from tests.passes.exports import ort_run
from tests.passes.transformer_util import RNG, c, feeds, model, node, run

X = [1, 8, 12, 12]


def _typed(m):
    for o in m.graph.output:
        o.type.tensor_type.elem_type = 1
    return m


def _block(after=(("Mul", 0.8), ("Add", -0.3)), group=8, outputs=("y",), vector=False,
           act="HardSwish"):
    """x -> depthwise 3x3 Conv (pad 1) -> HardSwish -> the ops in ``after`` -> y."""
    inits = {"W": c(RNG.standard_normal((8, 8 // group, 3, 3))), "B": c(RNG.standard_normal(8))}
    nodes = [node("Conv", ["x", "W", "B"], "t", name="conv", pads=[1, 1, 1, 1], group=group),
             node(act, ["t"], "h", name="act")]
    cur = "h"
    for i, (op, v) in enumerate(after):
        k = f"k{i}"
        inits[k] = c(RNG.uniform(0.5, 1.5, (1, 8, 1, 1))) if vector else c([v])
        out = "y" if i == len(after) - 1 else f"m{i}"
        nodes.append(node(op, [cur, k], out, name=op.lower()))
        cur = out
    return _typed(model(nodes, {"x": X}, list(outputs), inits, opset=14))


@pytest.mark.parametrize("after", [
    (("Mul", 0.8), ("Add", -0.3)),           # PP-LCNetV3's affine block
    (("Add", 0.25),),
    (("Div", 2.0), ("Sub", 0.1), ("Mul", 1.5)),
])
def test_fuse_act_affine_structure_numerics(after):
    m = _block(after)
    g = optimize(import_onnx(m), device="cpu")
    assert [n.op for n in g.nodes] == [FC.FusedConv]
    a = g.nodes[0].attrs
    s, t = 1.0, 0.0
    for op, v in after:
        s, t = {"Mul": (s * v, t * v), "Div": (s / v, t / v), "Add": (s, t + v),
                "Sub": (s, t - v)}[op]
    assert a.activation == "HardSwishAffine"
    assert a.alpha == pytest.approx(s, rel=1e-6) and a.beta == pytest.approx(t, rel=1e-6)
    f = feeds(x=X)
    want = ort_run(m, f)[0]
    np.testing.assert_allclose(run(g, f)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [8, 1])
def test_engine_with_the_epilogue_matches_onnxruntime(tmp_path, group):
    """Built and run: the conv takes a native kernel (depthwise, Winograd or direct) or
    oneDNN (the affine then in torch), by its timed tactic; either way onnxruntime's result."""
    m = _block(group=group)
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    eng = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    assert [n.attrs.activation for n in eng.graph.nodes] == ["HardSwishAffine"]
    f = feeds(x=X)
    ctx = eng.create_context()
    for _ in range(2):  # traced, then the planned program
        got = ctx.run(f)["y"]
        np.testing.assert_allclose(np.asarray(got), ort_run(m, f)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["per_channel", "read_twice", "relu", "constant_over_y"])
def test_no_fuse_act_affine(case):
    if case == "per_channel":  # one value per channel: the epilogue has two scalars
        m = _block(vector=True)
    elif case == "read_twice":  # the activation's output is read too
        m = _block(outputs=("y", "h"))
    elif case == "relu":  # only HardSwish has the affine epilogue
        m = _block(act="Relu")
    else:  # k / y
        m = _block(after=())
        m.graph.initializer.append(__import__("onnx").numpy_helper.from_array(c([2.0]), "k9"))
        m.graph.node.append(node("Div", ["k9", "h"], "y", name="div"))
        m.graph.output[0].name = "y"
    g = optimize(import_onnx(m), device="cpu")
    assert all(n.attrs.activation != "HardSwishAffine" for n in g.nodes
               if n.op is FC.FusedConv)
    f = feeds(x=X)
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-3, atol=1e-5)


def test_cuda_pipeline_leaves_it_out():
    g = optimize(import_onnx(_block()), device="cuda")
    assert all(getattr(n.attrs, "activation", "") != "HardSwishAffine" for n in g.nodes)
