"""Resize / Upsample / GridSample / AffineGrid / RoiAlign / NonMaxSuppression kernels against
onnx.reference (or NumPy)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.errors import KilnError
from kiln.frontend.convert import import_onnx
from tests.ops.harness import (
    assert_close,
    check_against_reference,
    node_model,
    run_kiln,
    run_reference,
)

RNG = np.random.default_rng(0)


def _resize_model(x, roi=None, scales=None, sizes=None, opset=19, **attrs):
    """Resize with roi/scales/sizes as initializers (constants, so the shape rule sees them)."""
    inits, names = [], ["X"]
    for name, v in (("roi", roi), ("scales", scales), ("sizes", sizes)):
        if v is None:
            names.append("")
        else:
            names.append(name)
            inits.append(numpy_helper.from_array(v, name))
    while names[-1] == "":
        names.pop()
    node = helper.make_node("Resize", names, ["y0"], **attrs)
    vin = [helper.make_tensor_value_info("X", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)]
    vout = [helper.make_tensor_value_info("y0", TensorProto.UNDEFINED, None)]
    graph = helper.make_graph([node], "t", vin, vout, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check_loose(m, inputs, atol=1e-5):
    """float32 interpolation against the float64 reference: cancellation in the cubic taps
    costs a few ulps more than the harness' default tolerance."""
    for g, w in zip(run_kiln(m, inputs), run_reference(m, inputs)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("coord", ["half_pixel", "align_corners", "asymmetric",
                                   "pytorch_half_pixel", "half_pixel_symmetric"])
def test_resize_scales(mode, coord):
    x = RNG.standard_normal((2, 3, 5, 7)).astype(np.float32)
    m = _resize_model(x, scales=np.array([1, 1, 1.6, 0.7], np.float32), mode=mode,
                      coordinate_transformation_mode=coord)
    _check_loose(m, {"X": x})


INTERPOLATED = [  # mode, coord, (sizes | scales): one F.interpolate pass, as ONNX computes it
    ("linear", "half_pixel", {"sizes": [1, 3, 40, 24]}),          # up, odd factors
    ("linear", "half_pixel", {"sizes": [1, 3, 4, 3]}),            # down
    ("linear", "pytorch_half_pixel", {"scales": [1, 1, 8.0, 8.0]}),
    ("linear", "align_corners", {"sizes": [1, 3, 17, 9]}),
    ("nearest", "asymmetric", {"scales": [1, 1, 2.0, 4.0]}),      # FPN's x2, an x4
]


@pytest.mark.parametrize("mode,coord,size", INTERPOLATED,
                         ids=[f"{m}-{c}-{i}" for i, (m, c, _) in enumerate(INTERPOLATED)])
def test_resize_interpolate_fast_path(mode, coord, size, monkeypatch):
    from kiln.kernels.torch import vision as KV

    def no_separable(*a):
        raise AssertionError("the separable path ran")

    monkeypatch.setattr(KV, "_resize_axis", no_separable)
    x = RNG.standard_normal((1, 3, 5, 6)).astype(np.float32)
    arrays = {k: np.array(v, np.int64 if k == "sizes" else np.float32) for k, v in size.items()}
    m = _resize_model(x, **arrays, mode=mode, coordinate_transformation_mode=coord,
                      nearest_mode="floor")
    _check_loose(m, {"X": x})


@pytest.mark.parametrize("mode,coord,scales", [
    ("nearest", "asymmetric", [1, 1, 3.0, 3.0]),   # x3: torch's float32 1/3 could floor apart
    ("linear", "half_pixel", [1, 1, 1.6, 0.7]),    # out / in is not the scale
    ("linear", "half_pixel_symmetric", [1, 1, 2.0, 2.0]),
])
def test_resize_separable_where_interpolate_differs(mode, coord, scales):
    import torch

    from kiln.kernels.torch import vision as KV

    x = RNG.standard_normal((1, 3, 5, 6)).astype(np.float32)
    shape = list(x.shape)
    out = [int(np.floor(s * d)) for s, d in zip(scales, shape)]
    opts = {"mode": mode, "coord": coord, "nearest_mode": "floor", "antialias": False,
            "exclude_outside": False}
    assert KV._interpolate(torch.from_numpy(x), shape, out, scales, {}, opts) is None
    m = _resize_model(x, scales=np.array(scales, np.float32), mode=mode,
                      coordinate_transformation_mode=coord, nearest_mode="floor")
    _check_loose(m, {"X": x})


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_antialias_sizes(mode):
    x = RNG.standard_normal((1, 2, 9, 11)).astype(np.float32)
    m = _resize_model(x, sizes=np.array([1, 2, 4, 5], np.int64), mode=mode, antialias=1)
    _check_loose(m, {"X": x})


def test_resize_tf_crop_and_resize_uint8():
    x = RNG.integers(0, 255, (1, 1, 6, 6)).astype(np.uint8)
    roi = np.array([0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], np.float32)
    m = _resize_model(x, roi=roi, sizes=np.array([1, 1, 4, 5], np.int64), mode="linear",
                      coordinate_transformation_mode="tf_crop_and_resize",
                      extrapolation_value=7.0)
    check_against_reference(m, {"X": x})


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
def test_resize_keep_aspect_ratio_axes(policy):
    x = RNG.standard_normal((1, 2, 4, 6)).astype(np.float32)
    m = _resize_model(x, sizes=np.array([7, 5], np.int64), mode="nearest", axes=[3, 2],
                      keep_aspect_ratio_policy=policy, nearest_mode="ceil")
    check_against_reference(m, {"X": x})


def test_resize_opset10_and_upsample():
    x = RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)
    want = x.repeat(2, axis=2).repeat(3, axis=3)
    scales = np.array([1, 1, 2, 3], np.float32)
    m10 = helper.make_model(helper.make_graph(
        [helper.make_node("Resize", ["X", "s"], ["y0"])], "t",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(scales, "s")]),
        opset_imports=[helper.make_opsetid("", 10)])
    assert_close(run_kiln(m10, {"X": x})[0], want)
    mu = node_model("Upsample", {"X": x, "scales": scales}, opset=9, mode="nearest")
    assert_close(run_kiln(mu, {"X": x, "scales": scales})[0], want)


def test_resize_shape_rule_symbolic():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, "H", 10])
    node = helper.make_node("Resize", ["X", "", "s"], ["Y"], mode="nearest")
    g = import_onnx(helper.make_model(helper.make_graph(
        [node], "t", [x], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([1, 1, 2, 0.5], np.float32), "s")])))
    assert tuple(str(d) for d in g.outputs[0].type.shape) == ("N", "3", "2*H", "5")


def test_resize_needs_scales_or_sizes():
    x = RNG.standard_normal((1, 1, 2, 2)).astype(np.float32)
    node = helper.make_node("Resize", ["X", "", "s"], ["y0"])
    m = helper.make_model(helper.make_graph(
        [node], "t", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x.shape),
                      helper.make_tensor_value_info("s", TensorProto.FLOAT, [0])],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)]))
    with pytest.raises(Exception, match="scales or sizes"):
        run_kiln(m, {"X": x, "s": np.zeros((0,), np.float32)})


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_2d(mode, padding, align):
    inputs = {"X": RNG.standard_normal((2, 3, 4, 5)).astype(np.float32),
              "G": RNG.uniform(-1.3, 1.3, (2, 3, 6, 2)).astype(np.float32)}
    m = node_model("GridSample", inputs, mode=mode, padding_mode=padding, align_corners=align)
    check_against_reference(m, inputs)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_3d(mode):
    inputs = {"X": RNG.standard_normal((1, 2, 3, 4, 5)).astype(np.float32),
              "G": RNG.uniform(-1.1, 1.1, (1, 2, 3, 4, 3)).astype(np.float32)}
    check_against_reference(node_model("GridSample", inputs, mode=mode), inputs)


@pytest.mark.parametrize("dims", [(2, 3, 5, 6), (2, 3, 4, 5, 6)])
@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid(dims, align):
    k = len(dims) - 2
    theta = RNG.standard_normal((dims[0], k, k + 1)).astype(np.float32)
    inputs = {"theta": theta, "size": np.array(dims, np.int64)}
    check_against_reference(node_model("AffineGrid", inputs, align_corners=align), inputs)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("coord", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("ratio", [0, 2])
def test_roi_align(mode, coord, ratio):
    inputs = {"X": RNG.standard_normal((2, 3, 8, 9)).astype(np.float32),
              "rois": np.array([[0, 0, 7, 7], [1.5, 2.2, 6.1, 5.3], [-2, 3, 12, 11]],
                               np.float32),
              "bi": np.array([0, 1, 1], np.int64)}
    m = node_model("RoiAlign", inputs, mode=mode, coordinate_transformation_mode=coord,
                   output_height=3, output_width=4, sampling_ratio=ratio, spatial_scale=0.9)
    check_against_reference(m, inputs)


@pytest.mark.parametrize("center", [0, 1])
def test_nms(center):
    boxes = RNG.uniform(0, 10, (2, 20, 4)).astype(np.float32)
    if center:
        boxes[..., 2:] = np.abs(boxes[..., 2:]) / 2
    inputs = {"boxes": boxes, "scores": RNG.uniform(0, 1, (2, 3, 20)).astype(np.float32),
              "max_out": np.array([4], np.int64), "iou": np.array([0.3], np.float32),
              "score": np.array([0.2], np.float32)}
    m = node_model("NonMaxSuppression", inputs, center_point_box=center)
    check_against_reference(m, inputs)


def test_nms_no_limit_selects_nothing():
    inputs = {"boxes": RNG.uniform(0, 10, (1, 5, 4)).astype(np.float32),
              "scores": RNG.uniform(0, 1, (1, 1, 5)).astype(np.float32)}
    out = run_kiln(node_model("NonMaxSuppression", inputs), inputs)[0]
    assert out.shape == (0, 3) and out.dtype == np.int64


def test_grid_sample_rank_mismatch_rejected():
    inputs = {"X": RNG.standard_normal((1, 1, 4, 4)).astype(np.float32),
              "G": RNG.standard_normal((1, 2, 2, 2, 3)).astype(np.float32)}
    m = node_model("GridSample", inputs)
    m.ir_version = onnx.IR_VERSION
    with pytest.raises(KilnError, match="GridSample"):
        run_kiln(m, inputs)
