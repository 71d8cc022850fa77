"""qconv.c, ConvInteger on qgemm's VNNI tile: the int32 sums against a numpy int64 reference
(uint8/int8 codes and weights, strides, dilations, asymmetric pads, pixels past a panel, a
kernel larger than the input), ConvIntegerScaled's float steps to the bit, which layers
int_conv sends there (and which it must not: groups, per-channel weight zero points), and a
DynamicQuantizeLinear -> ConvInteger model against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln import native

pytestmark = pytest.mark.skipif(not native.available or not native.qconv_available(),
                                reason="qconv needs kiln's native library and AVX512-VNNI")

CASES = [  # n, c, h, w, oc, kh, kw, strides, pads (t, l, b, r), dilations
    (1, 24, 32, 64, 24, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
    (2, 5, 7, 9, 33, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1)),
    (1, 3, 11, 13, 7, 3, 3, (2, 1), (0, 0, 0, 0), (2, 2)),
    (1, 192, 8, 16, 64, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)),
    (1, 1, 64, 30, 9, 3, 3, (2, 2), (1, 0, 2, 1), (1, 1)),
    (1, 16, 5, 40, 9, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1)),
    (1, 7, 2, 3, 5, 3, 4, (1, 1), (2, 3, 2, 3), (1, 1)),
    # panels of 32 pixels within one output row (masked row loads at the edges): stride 2,
    # stride 1 with a dilated kernel, pads wider than a panel's span
    (1, 24, 32, 128, 16, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1)),
    (1, 8, 6, 96, 5, 3, 5, (1, 1), (1, 2, 1, 2), (2, 1)),
    (1, 3, 8, 66, 4, 1, 7, (1, 2), (0, 40, 0, 40), (1, 1)),
    (1, 4, 9, 70, 8, 3, 3, (1, 2), (0, 2, 1, 3), (1, 2)),
]


def _codes(rng, signed, shape):
    lo = -128 if signed else 0
    return rng.integers(lo, lo + 256, shape).astype(np.int8 if signed else np.uint8)


def _ref(x, xz, w, wz, strides, pads, dils):
    xp = np.pad(x.astype(np.int64) - xz, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    return torch.nn.functional.conv2d(torch.from_numpy(xp), torch.from_numpy(
        w.astype(np.int64) - wz), None, strides, 0, dils).numpy()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("x_signed,w_signed", [(False, False), (True, False), (False, True)])
def test_qconv_matches_int_reference(case, x_signed, w_signed):
    n, c, h, w, oc, kh, kw, strides, pads, dils = case
    rng = np.random.default_rng(hash(case) % 1000)
    x, wt = _codes(rng, x_signed, (n, c, h, w)), _codes(rng, w_signed, (oc, c, kh, kw))
    x.flat[0] = 127 if x_signed else 255  # ends of the ranges
    wt.flat[0] = -128 if w_signed else 0
    xz, wz = int(_codes(rng, x_signed, ())), int(_codes(rng, w_signed, ()))
    got = native.qconv(torch.from_numpy(x), xz, native.QConvWeight(torch.from_numpy(wt), wz),
                       strides, pads, dils)
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), _ref(x, xz, wt, wz, strides, pads, dils))


def test_qconv_scaled_is_the_torch_steps_to_the_bit():
    """float32(sums + int32(floor(B / S))) * S, each step in its own dtype."""
    rng = np.random.default_rng(3)
    x, wt = _codes(rng, False, (1, 48, 16, 32)), _codes(rng, False, (70, 48, 3, 3))
    b = torch.from_numpy((rng.standard_normal(70) * 3).astype(np.float32))
    s = np.float32(0.000731)
    qw = native.QConvWeight(torch.from_numpy(wt), 121)
    got = native.qconv(torch.from_numpy(x), 17, qw, (1, 1), (1, 1, 1, 1), (1, 1), b, float(s))
    acc = torch.from_numpy(_ref(x, 17, wt, 121, (1, 1), (1, 1, 1, 1), (1, 1)).astype(np.int32))
    bq = torch.floor(torch.div(b, torch.tensor(s))).to(torch.int32).reshape(1, -1, 1, 1)
    want = (acc + bq).to(torch.float32) * torch.tensor(s)
    assert torch.equal(got, want)


def _attrs(**kw):
    from kiln.ops import quant as Q
    return Q.ConvInteger.make_attrs(**kw)


@pytest.mark.parametrize("kind", ["2d", "1d"])
def test_int_conv_takes_qconv(kind):
    from kiln.kernels.torch.quant_linear import int_conv
    rng = np.random.default_rng(4)
    shape, wshape = ((1, 6, 9, 10), (5, 6, 3, 3)) if kind == "2d" else ((2, 6, 17), (5, 6, 3))
    x, w = torch.from_numpy(_codes(rng, False, shape)), torch.from_numpy(_codes(rng, False, wshape))
    xz, wz = torch.tensor(3, dtype=torch.uint8), torch.tensor(200, dtype=torch.uint8)
    a = _attrs(pads=[1, 2] if kind == "1d" else [1, 0, 2, 1], strides=[2] * (x.dim() - 2))
    cache = {}
    got = int_conv(x, w, xz, wz, a, cache)
    assert cache["qconv_w"][2] is not None and len(cache["qconv_plans"]) == 1
    int_conv(x, w, xz, wz, a, cache)
    assert len(cache["qconv_plans"]) == 1  # planned once per shape
    want = int_conv(x, w, xz, wz, a, None)  # no cache: the float32 convolutions
    assert got.dtype == want.dtype == torch.int32
    assert torch.equal(got, want)


def test_int_conv_takes_qconv_with_equal_per_channel_zeros():
    """A per-channel zero point whose entries are all the same (int8 weights' zeros) is one."""
    from kiln.kernels.torch.quant_linear import int_conv
    rng = np.random.default_rng(8)
    x = torch.from_numpy(_codes(rng, False, (1, 5, 6, 7)))
    w = torch.from_numpy(_codes(rng, True, (6, 5, 3, 3)))
    wz = torch.zeros(6, dtype=torch.int8)
    a = _attrs(pads=[1, 1, 1, 1])
    cache = {}
    got = int_conv(x, w, torch.tensor(7, dtype=torch.uint8), wz, a, cache)
    assert cache["qconv_w"][2] is not None
    want = torch.nn.functional.conv2d(x.to(torch.int64) - 7, w.to(torch.int64), None, 1, 1)
    assert torch.equal(got.to(torch.int64), want)


@pytest.mark.parametrize("why", ["group", "per_channel_zero", "float_codes"])
def test_no_qconv_where_it_cannot_take_the_layer(why):
    """Must not fire: two groups, a weight zero point per output channel, float input; the
    float32 path computes the same integers."""
    from kiln.kernels.torch.quant_linear import int_conv
    rng = np.random.default_rng(5)
    x = torch.from_numpy(_codes(rng, False, (1, 4, 6, 6)))
    w = torch.from_numpy(_codes(rng, False, (6, 2 if why == "group" else 4, 3, 3)))
    wz = torch.tensor([9, 200, 3, 4, 5, 6], dtype=torch.uint8) if why == "per_channel_zero" \
        else torch.tensor(9, dtype=torch.uint8)
    if why == "float_codes":
        x = x.to(torch.float32)
    a = _attrs(group=2 if why == "group" else 1, pads=[1, 1, 1, 1])
    cache = {}
    got = int_conv(x, w, torch.tensor(1, dtype=torch.uint8), wz, a, cache)
    assert cache.get("qconv_w", (None, None, None))[2] is None
    xi = x.to(torch.int64) - 1
    wi = w.to(torch.int64) - wz.to(torch.int64).reshape(-1, 1, 1, 1) if wz.numel() > 1 \
        else w.to(torch.int64) - 9
    want = torch.nn.functional.conv2d(xi, wi, None, 1, 1, 1, a.group or 1)
    assert torch.equal(got.to(torch.int64), want)


def test_dynamic_conv_model_on_qconv_matches_onnxruntime(tmp_path, monkeypatch):
    """ddddocr's DynamicQuantizeLinear -> ConvInteger (+ bias, rescale) as one
    DynamicConvInteger on qconv (kiln_dq_qconv): onnxruntime's output to the bit."""
    ort = pytest.importorskip("onnxruntime")
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from kiln import Builder, BuilderConfig
    rng = np.random.default_rng(6)
    w = rng.integers(0, 256, (40, 24, 3, 3)).astype(np.uint8)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.uint8(119), "wz"),
             numpy_helper.from_array(np.array(0.004, np.float32), "ws"),
             numpy_helper.from_array((rng.standard_normal(40) * 0.5).astype(np.float32), "B"),
             numpy_helper.from_array(np.array([1, -1, 1, 1], np.int64), "shape")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("Mul", ["xs", "ws"], ["s"]),
             helper.make_node("Div", ["B", "s"], ["bd"]),
             helper.make_node("Floor", ["bd"], ["bf"]),
             helper.make_node("Cast", ["bf"], ["bi"], to=TensorProto.INT32),
             helper.make_node("Reshape", ["bi", "shape"], ["br"]),
             helper.make_node("ConvInteger", ["xq", "W", "xz", "wz"], ["acc"], pads=[1, 1, 1, 1],
                              strides=[2, 1]),
             helper.make_node("Add", ["acc", "br"], ["sum"]),
             helper.make_node("Cast", ["sum"], ["sumf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["sumf", "s"], ["y"])]
    g = helper.make_graph(
        nodes, "dynconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 24, 13, 70])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    path = tmp_path / "dynconv.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    calls = []
    real = native.QConvPlan.run_dynamic
    monkeypatch.setattr(native.QConvPlan, "run_dynamic",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    e = Builder(BuilderConfig(device="cpu")).build(path)
    assert list(e.choices.values()).count("TorchDynamicConvInteger") == 1
    x = rng.standard_normal((1, 24, 13, 70)).astype(np.float32) * 3
    got = e.create_context().run({"x": x})["y"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    assert calls  # on qconv, not the float32 convolutions

