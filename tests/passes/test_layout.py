"""set_conv_layout: 2-D float32 convs run channels-last through oneDNN with packed weights."""

from __future__ import annotations

import numpy as np

import kiln
from kiln.engine.engine import load
from kiln.frontend import import_onnx
from kiln.ops import fused_conv as FC
from kiln.passes.fusion.conv_bias_act import fuse_conv_bias_act
from kiln.passes.fusion.layout import set_conv_layout
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node, run

X = [2, 4, 9, 9]


def _block():
    """conv1 + relu -> conv2 (stride 2) + residual conv3 + relu -> maxpool -> y."""
    inits = {f"W{i}": c(RNG.standard_normal((8, 4 if i != 2 else 8, 3, 3)) * 0.2)
             for i in (1, 2, 3)}
    inits.update({f"B{i}": c(RNG.standard_normal(8)) for i in (1, 2, 3)})
    nodes = [node("Conv", ["x", "W1", "B1"], "a", name="conv1", pads=[1, 1, 1, 1]),
             node("Relu", ["a"], "ar", name="relu1"),
             node("Conv", ["ar", "W2", "B2"], "b", name="conv2", pads=[1, 1, 1, 1],
                  strides=[2, 2]),
             node("Conv", ["x", "W3", "B3"], "d", name="conv3", pads=[1, 1, 1, 1],
                  strides=[2, 2]),
             node("Add", ["b", "d"], "s", name="add"), node("Relu", ["s"], "sr", name="relu2"),
             node("MaxPool", ["sr"], "y", name="pool", kernel_shape=[2, 2])]
    return model(nodes, {"x": X}, ["y"], inits)


def _both(g, log):
    return fuse_conv_bias_act(g, log) + set_conv_layout(g, log)


def test_set_conv_layout_structure_and_counts():
    g, before, after, n, logs = apply(_block(), _both, feeds(x=X), atol=1e-4)
    assert before == {"Add": 1, "Conv": 3, "MaxPool": 1, "Relu": 2}
    assert after == {"FusedConv": 3, "MaxPool": 1}
    assert all(x.attrs.layout == "nhwc" for x in g.nodes if x.op is FC.FusedConv)
    assert "layout conv2: NHWC, packed weight" in logs  # the plain conv became a FusedConv
    # the residual joins the product computed last
    assert [x.name for x in g.nodes if x.op is FC.FusedConv][-1] == "conv3 + add + relu2"


def test_set_conv_layout_numerics_other_batch():
    m = _block()
    g, _, _, _, _ = apply(m, _both, feeds(x=X), atol=1e-4)  # packs weights for batch 2
    big = feeds(x=[5, 4, 9, 9])
    np.testing.assert_allclose(run(g, big)[0], run(import_onnx(m), big)[0], atol=1e-4)


def test_set_conv_layout_engine_roundtrip(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_block().SerializeToString())
    engine = kiln.Builder(kiln.BuilderConfig()).build(str(path))
    x = feeds(x=X)
    want = engine.create_context().run(x)
    engine.save(tmp_path / "m.kiln")
    got = load(tmp_path / "m.kiln").create_context().run(x)
    ref = kiln.Builder(kiln.BuilderConfig(optimize=False)).build(str(path)).create_context().run(x)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), atol=1e-4)


def test_no_fuse_layout_conv_weight_not_constant():
    m = model([node("Conv", ["x", "W"], "y", name="conv")], {"x": X, "W": [8, 4, 3, 3]}, ["y"])
    _, before, after, n, _ = apply(m, set_conv_layout, feeds(x=X, W=[8, 4, 3, 3]))
    assert n == 0 and before == after


def test_no_fuse_layout_conv_1d():
    m = model([node("Conv", ["x", "W"], "y", name="conv")], {"x": [2, 4, 9]}, ["y"],
              {"W": c(RNG.standard_normal((8, 4, 3)))})
    _, before, after, n, _ = apply(m, set_conv_layout, feeds(x=[2, 4, 9]))
    assert n == 0 and before == after
