"""Profile specialization on a real export: a CNN with TF "same" padding computed from the
input's size at run time (Shape -> Gather -> arithmetic -> Concat -> Pad), built with a fixed
profile (every shape subgraph folds, the Pads fold into the convs) and without (they stay)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kiln.builder import Builder, BuilderConfig
from kiln.engine.profile import Profile
from kiln.errors import ShapeError
from kiln.frontend import fixed_dims, import_onnx
from tests.cli.test_cli import kiln_cmd
from tests.passes.exports import ort_run, same_pad_cnn

SHAPE = (1, 3, 48, 64)
SHAPE_ARITH = {"Shape", "Gather", "Concat", "Sub", "Div", "Mod", "Where", "Pad", "Unsqueeze"}


def _build(data, profiles):
    b = Builder(BuilderConfig(profiles=profiles))
    return b.build(data), b.report


def _x(shape=SHAPE):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_specialize_fixed_profile_folds_shape_arithmetic():
    data = same_pad_cnn()
    engine, rep = _build(data, [Profile.fixed({"x": SHAPE})])
    before, after = rep["nodes_before"], rep["nodes_after"]
    assert before["Pad"] == 3 and before["Shape"] == 9 and sum(before.values()) == 343
    assert not SHAPE_ARITH & set(after), after
    assert after == {"FusedConv": 4, "ReduceMean": 1, "SqueezeExcite": 1}
    assert engine.inputs[0].shape == SHAPE  # the input itself is specialized
    got = engine.create_context().run({"x": _x()})["y"]
    np.testing.assert_allclose(got, ort_run(data, {"x": _x()})[0], rtol=1e-4, atol=1e-5)


def test_no_specialize_profile_range_keeps_shape_arithmetic():
    # a range over H and W fixes only the batch dim: the padding arithmetic must stay
    p = Profile({"x": (1, 3, 32, 32)}, {"x": SHAPE}, {"x": (1, 3, 96, 96)})
    assert fixed_dims([p]) == {"x": (1, 3, None, None)}
    engine, rep = _build(same_pad_cnn(), [p])
    assert rep["nodes_after"]["Pad"] == 3 and "Shape" in rep["nodes_after"]
    ctx = engine.create_context()
    for shape in (SHAPE, (1, 3, 33, 95)):  # odd sizes: uneven same padding
        want = ort_run(same_pad_cnn(), {"x": _x(shape)})[0]
        np.testing.assert_allclose(ctx.run({"x": _x(shape)})["y"], want, rtol=1e-4, atol=1e-5)


def test_specialize_shared_dim_name_fixes_every_input():
    m = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["a", "b"], ["c"])], "g",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["batch", 4])
         for n in ("a", "b")],
        [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, None)]))
    g = import_onnx(m, fixed=fixed_dims([Profile.fixed({"a": (2, 4)})]))
    assert [v.type.shape for v in g.inputs] == [(2, 4), (2, 4)]


def _paddle_style(tmp_path, dims=(-1, 3, -1, -1)):
    m = onnx.load_from_string(same_pad_cnn())
    for d, v in zip(m.graph.input[0].type.tensor_type.shape.dim, dims):
        d.Clear()
        d.dim_value = v  # Paddle writes dynamic dims as -1 (and some converters as 0)
    path = tmp_path / "paddle_style.onnx"
    onnx.save(m, path)
    return path


def test_frontend_dim_value_minus_one_is_dynamic(tmp_path):
    # 0 too (onnxruntime reads a 0 on an input as a fixed empty dim; kiln takes it as unknown)
    shape = import_onnx(_paddle_style(tmp_path, (-1, 3, 0, -1))).inputs[0].type.shape
    assert shape[1] == 3 and [str(d) for d in shape[::2]] == ["x_dim0", "x_dim2"]
    assert str(shape[3]) == "x_dim3"
    path = _paddle_style(tmp_path)
    engine, _ = _build(str(path), [Profile.fixed({"x": SHAPE})])
    want = ort_run(onnx.load(path), {"x": _x()})[0]
    np.testing.assert_allclose(engine.create_context().run({"x": _x()})["y"], want, rtol=1e-4,
                               atol=1e-5)


def test_frontend_dim_value_minus_one_cli_build(tmp_path):
    path = _paddle_style(tmp_path)
    p = kiln_cmd("build", path, "-o", tmp_path / "m.kiln", "--shapes", "x:1x3x48x64")
    assert "nodes -> 6 layers" in p.stdout, p.stdout
    # the dims the model does fix are still checked
    with pytest.raises(ShapeError, match="sets dim 1 to 4, but the model fixes it at 3"):
        _build(str(path), [Profile.fixed({"x": (1, 4, 48, 64)})])
