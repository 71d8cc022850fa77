"""Unit tests for the nn family: convolutions, pooling, normalizations, softmax, matmul."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from kiln.errors import KilnError
from kiln.frontend import import_onnx
from tests.ops.harness import (
    assert_close,
    check_against_reference,
    node_model,
    run_kiln,
    run_reference,
)

RNG = np.random.default_rng(0)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def check(op, inputs, n_out=1, opset=None, **attrs):
    check_against_reference(node_model(op, inputs, n_out, opset, **attrs), inputs)


# ---------------------------------------------------------------- convolutions


@pytest.mark.parametrize("attrs", [
    {"pads": [1, 0, 2, 1], "strides": [2, 1]},  # asymmetric pads
    {"auto_pad": "SAME_LOWER", "strides": [2, 2]},
    {"auto_pad": "SAME_UPPER", "dilations": [2, 1]},
    {"auto_pad": "VALID", "strides": [1, 2]},
    {"pads": [1, 1, 1, 1], "group": 2},
])
def test_conv_2d(attrs):
    x, w, b = f32(2, 4, 7, 8), f32(6, 4 // attrs.get("group", 1), 3, 3), f32(6)
    check("Conv", {"x": x, "w": w, "b": b}, **attrs)


@pytest.mark.parametrize(("shape", "kernel"), [((1, 2, 9), (3, 2, 3)),
                                               ((1, 2, 5, 4, 6), (2, 2, 2, 3, 2))])
def test_conv_1d_3d(shape, kernel):
    check("Conv", {"x": f32(*shape), "w": f32(*kernel)}, strides=[2] * (len(shape) - 2))


def test_conv_4_spatial_dims_uses_unfold_path():
    x, w = f32(1, 2, 4, 4, 3, 5), f32(3, 2, 2, 2, 2, 2)
    got = run_kiln(node_model("Conv", {"x": x, "w": w}), {"x": x, "w": w})[0]
    # direct sum over the 2x2x2x2 window as the oracle
    want = np.zeros((1, 3, 3, 3, 2, 4), np.float64)
    for idx in np.ndindex(2, 2, 2, 2):
        sl = tuple(slice(i, i + o) for i, o in zip(idx, want.shape[2:]))
        want += np.einsum("nchwdt,mc->nmhwdt", x[(slice(None), slice(None), *sl)],
                          w[(slice(None), slice(None), *idx)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _conv_transpose_oracle(x, w, b, s, d, pads, out_pad, group):
    """Scatter every input pixel times the kernel into the full output, then pad/crop."""
    nb, c, h, wd = x.shape
    mg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    full = np.zeros((nb, mg * group, (h - 1) * s[0] + (kh - 1) * d[0] + 1 + out_pad[0],
                     (wd - 1) * s[1] + (kw - 1) * d[1] + 1 + out_pad[1]), np.float64)
    for g in range(group):
        cs, ms = slice(g * c // group, (g + 1) * c // group), slice(g * mg, (g + 1) * mg)
        for i, j in np.ndindex(kh, kw):
            contrib = np.einsum("nchw,cm->nmhw", x[:, cs], w[cs, :, i, j])
            full[:, ms, i * d[0]:i * d[0] + (h - 1) * s[0] + 1:s[0],
                 j * d[1]:j * d[1] + (wd - 1) * s[1] + 1:s[1]] += contrib
    out = full[:, :, pads[0]:full.shape[2] - pads[2], pads[1]:full.shape[3] - pads[3]]
    return out + b.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("attrs", [
    {"strides": [2, 2], "pads": [0, 1, 1, 0], "output_padding": [1, 1]},
    {"strides": [1, 1], "output_padding": [1, 0], "pads": [1, 0, 0, 0]},  # output_padding >= stride
    {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 1, 1, 1]},
    {"strides": [1, 1], "dilations": [2, 2], "group": 2},
])
def test_conv_transpose(attrs):
    group = attrs.get("group", 1)
    x, w, b = f32(1, 4, 3, 4), f32(4, 3, 3, 3), f32(3 * group)
    got = run_kiln(node_model("ConvTranspose", {"x": x, "w": w, "b": b}, **attrs),
                   {"x": x, "w": w, "b": b})[0]
    want = _conv_transpose_oracle(x, w, b, attrs["strides"], attrs.get("dilations", [1, 1]),
                                  attrs.get("pads", [0] * 4), attrs.get("output_padding", [0, 0]),
                                  group)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_conv_transpose_same_upper():
    x, w = f32(1, 2, 3, 3), f32(2, 2, 3, 3)
    got = run_kiln(node_model("ConvTranspose", {"x": x, "w": w}, strides=[2, 2],
                              auto_pad="SAME_UPPER"), {"x": x, "w": w})[0]
    want = _conv_transpose_oracle(x, w, np.zeros(2, np.float32), [2, 2], [1, 1], [0, 0, 1, 1],
                                  [0, 0], 1)  # full 7 -> 6: total pad 1, at the end
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_deform_conv():
    x, w = f32(1, 4, 5, 5), f32(2, 2, 3, 3)
    offset = f32(1, 2 * 2 * 9, 4, 4) * 0.7
    mask = RNG.random((1, 2 * 9, 4, 4)).astype(np.float32)
    check("DeformConv", {"x": x, "w": w, "offset": offset, "b": f32(2), "mask": mask},
          pads=[1, 1, 0, 0], group=2, offset_group=2)


# ---------------------------------------------------------------- pooling


def _check_max_pool_indices(x, storage_order=0, **attrs):
    """Values against ONNX's reference; indices must point at the max (ONNX's flat layout)."""
    m = node_model("MaxPool", {"x": x}, 2, storage_order=storage_order, **attrs)
    y, idx = run_kiln(m, {"x": x})
    assert_close(y, np.asarray(run_reference(m, {"x": x})[0]))
    assert idx.dtype == np.int64
    flat = x.transpose(0, 1, 3, 2).reshape(-1) if storage_order else x.reshape(-1)
    np.testing.assert_array_equal(flat[idx], y)


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},  # torch fast path
    {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [0, 1, 2, 0]},  # asymmetric: unfold path
    {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER"},
])
def test_max_pool_with_indices(attrs):
    _check_max_pool_indices(f32(2, 3, 7, 6), **attrs)


def test_max_pool_storage_order_and_uint8():
    x = RNG.integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    check("MaxPool", {"x": x}, kernel_shape=[2, 2], strides=[2, 2])
    _check_max_pool_indices(f32(2, 2, 4, 5), storage_order=1, kernel_shape=[2, 2])
    _check_max_pool_indices(f32(1, 2, 5, 4), storage_order=1, kernel_shape=[2, 2],
                            pads=[1, 0, 0, 1])


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [2, 3], "pads": [0, 1, 1, 0]},
    {"kernel_shape": [2, 2], "dilations": [2, 2], "count_include_pad": 1, "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
])
def test_average_pool(attrs):
    check("AveragePool", {"x": f32(1, 2, 7, 8)}, **attrs)


def test_average_pool_ceil_last_window_in_pad():
    # ceil mode, window 3 stride 2 over 5 + pad 1: the third window is dropped (starts on pad)
    x = f32(1, 1, 5, 5)
    got = run_kiln(node_model("AveragePool", {"x": x}, kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1], ceil_mode=1), {"x": x})[0]
    assert got.shape == (1, 1, 3, 3)
    np.testing.assert_allclose(got[0, 0, 0, 0], x[0, 0, :2, :2].mean(), rtol=1e-5)


def test_lp_pool_and_global_pools():
    x = f32(2, 3, 6, 5)
    check("LpPool", {"x": x}, kernel_shape=[2, 2], strides=[2, 1], pads=[1, 0, 0, 1], p=3)
    for op in ("GlobalAveragePool", "GlobalMaxPool"):
        check(op, {"x": x})
    got = run_kiln(node_model("GlobalLpPool", {"x": x}, p=3), {"x": x})[0]
    want = (np.abs(x.astype(np.float64)) ** 3).sum((2, 3), keepdims=True) ** (1 / 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_max_unpool_roundtrip():
    x = f32(1, 2, 4, 4)
    y, idx = run_kiln(node_model("MaxPool", {"x": x}, 2, kernel_shape=[2, 2], strides=[2, 2]),
                      {"x": x})
    shape = np.array([1, 2, 5, 5], np.int64)
    inputs = {"y": y, "i": idx, "s": shape}
    check("MaxUnpool", inputs, kernel_shape=[2, 2], strides=[2, 2])


# ---------------------------------------------------------------- normalizations


def test_batch_norm_inference_and_training():
    x, s, b, m = f32(3, 4, 2, 2), f32(4), f32(4), f32(4)
    v = RNG.random(4).astype(np.float32) + 0.5
    inputs = {"x": x, "s": s, "b": b, "m": m, "v": v}
    check("BatchNormalization", inputs, epsilon=1e-3)
    check("BatchNormalization", inputs, n_out=3, training_mode=1, momentum=0.8)


def test_layer_norm_with_stats_and_broadcast_scale():
    x = f32(2, 3, 8)
    check("LayerNormalization", {"x": x, "s": f32(8), "b": f32(8)}, n_out=3)
    check("LayerNormalization", {"x": x, "s": f32(3, 8)}, axis=1)


def test_layer_norm_fp16_stashes_float32():
    x = f32(4, 16).astype(np.float16)
    m = node_model("LayerNormalization", {"x": x, "s": np.ones(16, np.float16)}, n_out=3)
    y, mean, inv = run_kiln(m, {"x": x, "s": np.ones(16, np.float16)})
    assert y.dtype == np.float16 and mean.dtype == np.float32 and inv.dtype == np.float32
    np.testing.assert_allclose(mean[:, 0], x.astype(np.float32).mean(1), rtol=1e-3, atol=1e-4)


def test_other_norms():
    x = f32(2, 6, 3, 4)
    check("InstanceNormalization", {"x": x, "s": f32(6), "b": f32(6)})
    check("GroupNormalization", {"x": x, "s": f32(6), "b": f32(6)}, num_groups=3)
    check("RMSNormalization", {"x": x, "s": f32(4)}, axis=-1, opset=23)
    check("MeanVarianceNormalization", {"x": x})


@pytest.mark.parametrize("size", [3, 4])  # even size: the window is asymmetric
def test_lrn(size):
    # ONNX's reference LRN loops over the wrong axis: a NumPy oracle instead
    x = f32(2, 6, 3, 4)
    got = run_kiln(node_model("LRN", {"x": x}, size=size, alpha=1e-2, beta=0.6, bias=2.0),
                   {"x": x})[0]
    sq = np.zeros_like(x, dtype=np.float64)
    for c in range(6):
        lo, hi = max(0, c - (size - 1) // 2), min(6, c + size // 2 + 1)
        sq[:, c] = (x[:, lo:hi].astype(np.float64) ** 2).sum(1)
    np.testing.assert_allclose(got, x / (2.0 + 1e-2 / size * sq) ** 0.6, rtol=1e-5)


def test_lp_normalization():
    x = f32(2, 6, 3)
    x[0, :, 1] = 0  # a zero slice stays zero
    for p in (1, 2):
        got = run_kiln(node_model("LpNormalization", {"x": x}, axis=1, p=p), {"x": x})[0]
        norm = (np.abs(x) ** p).sum(1, keepdims=True) ** (1 / p)
        want = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_group_norm_opset18_per_group_scale():
    x, s, b = f32(2, 6, 3), f32(3), f32(3)
    got = run_kiln(node_model("GroupNormalization", {"x": x, "s": s, "b": b}, opset=18,
                              num_groups=3), {"x": x, "s": s, "b": b})[0]
    g = x.reshape(2, 3, -1)
    want = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)
    want = want * s[None, :, None] + b[None, :, None]
    np.testing.assert_allclose(got, want.reshape(x.shape), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- softmax family, matmul


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_family(op, axis):
    x = f32(3, 4, 5)
    x[0, 0, :2] = 5.0  # a tie: Hardmax must pick the first maximum
    check(op, {"x": x}, axis=axis)


def test_softmax_fp16():
    check("Softmax", {"x": f32(4, 33).astype(np.float16)})


@pytest.mark.parametrize("sa,sb", [((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 3)), ((3, 4), (4,)),
                                   ((4,), (4,))])
def test_matmul_broadcast(sa, sb):
    check("MatMul", {"a": f32(*sa), "b": f32(*sb)})


def test_matmul_int():
    a = RNG.integers(-5, 5, (3, 4)).astype(np.int32)
    b = RNG.integers(-5, 5, (4, 2)).astype(np.int32)
    check("MatMul", {"a": a, "b": b})


@pytest.mark.parametrize("attrs", [{}, {"transA": 1, "alpha": 0.5}, {"transB": 1, "beta": 2.0}])
def test_gemm(attrs):
    a = f32(4, 3) if attrs.get("transA") else f32(3, 4)
    b = f32(5, 4) if attrs.get("transB") else f32(4, 5)
    check("Gemm", {"a": a, "b": b, "c": f32(5)}, **attrs)
    check("Gemm", {"a": a, "b": b}, **attrs)


def test_einsum_det_col2im():
    check("Einsum", {"a": f32(2, 3, 4), "b": f32(2, 4, 5)}, equation="bij, bjk -> bik")
    check("Einsum", {"a": f32(3, 3)}, equation="ii->i")
    check("Det", {"x": f32(2, 3, 3)})
    shapes = {"i": np.array([4, 5], np.int64), "b": np.array([2, 2], np.int64)}
    check("Col2Im", {"x": f32(1, 2 * 4, 12), **shapes})
    # asymmetric pads: the generic scatter path (padded image 5 x 6 -> 4 x 5 blocks)
    check("Col2Im", {"x": f32(1, 2 * 4, 20), **shapes}, pads=[1, 0, 0, 1])
    x3 = f32(1, 8, 8)
    check("Col2Im", {"x": x3, "i": np.array([3, 3, 3], np.int64),
                     "b": np.array([2, 2, 2], np.int64)})


# ---------------------------------------------------------------- shape rules, bad input


def _out_shapes(op, ins, n_out=1, **attrs):
    """Inferred output shapes, evaluated at N=2, H=7, W=9, B=3, S=5."""
    node = helper.make_node(op, [n for n, _ in ins], [f"y{i}" for i in range(n_out)], **attrs)
    vin = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in ins]
    vout = [helper.make_tensor_value_info(f"y{i}", 0, None) for i in range(n_out)]
    g = helper.make_graph([node], "g", vin, vout)
    graph = import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)]))
    env = {"N": 2, "H": 7, "W": 9, "B": 3, "S": 5}
    out = []
    for v in graph.outputs:
        assert v.type.shape is not None and None not in v.type.shape
        out.append(tuple(d if isinstance(d, int) else int(d.subs(
            {s: env[s.name] for s in d.free_symbols})) for d in v.type.shape))
    return out


def test_symbolic_shapes():
    x = ("x", ["N", 3, "H", "W"])
    assert _out_shapes("Conv", [x, ("w", [8, 3, 3, 3])], strides=[2, 2], pads=[1, 1, 1, 1]) == [
        (2, 8, 4, 5)]
    assert _out_shapes("Conv", [x, ("w", [8, 3, 3, 3])], strides=[2, 2],
                       auto_pad="SAME_UPPER") == [(2, 8, 4, 5)]
    assert _out_shapes("ConvTranspose", [x, ("w", [3, 4, 3, 3])], strides=[2, 2],
                       pads=[1, 1, 1, 1], output_padding=[1, 1]) == [(2, 4, 14, 18)]
    assert _out_shapes("MaxPool", [x], 2, kernel_shape=[2, 2], strides=[2, 2]) == [
        (2, 3, 3, 4)] * 2
    assert _out_shapes("AveragePool", [x], kernel_shape=[3, 3], strides=[2, 2],
                       pads=[1, 1, 1, 1]) == [(2, 3, 4, 5)]
    assert _out_shapes("GlobalAveragePool", [x]) == [(2, 3, 1, 1)]
    assert _out_shapes("LayerNormalization", [("x", ["B", "S", 8]), ("s", [8])], 3) == [
        (3, 5, 8), (3, 5, 1), (3, 5, 1)]
    assert _out_shapes("Softmax", [("x", ["B", "S", 8])]) == [(3, 5, 8)]
    assert _out_shapes("MatMul", [("a", ["B", 1, "S", 4]), ("b", [6, 4, "S"])]) == [
        (3, 6, 5, 5)]
    assert _out_shapes("Gemm", [("a", [8, "B"]), ("b", [5, 8])], transA=1, transB=1) == [(3, 5)]


def test_bad_inputs_raise():
    x, w = f32(1, 3, 5, 5), f32(4, 2, 3, 3)  # weight expects 2 input channels
    with pytest.raises(KilnError):
        run_kiln(node_model("Conv", {"x": x, "w": w}), {"x": x, "w": w})
    a, b = f32(2, 3), f32(4, 5)
    with pytest.raises(KilnError):
        run_kiln(node_model("MatMul", {"a": a, "b": b}), {"a": a, "b": b})


def test_reference_agrees_on_fast_conv_path():
    x, w = f32(1, 3, 9, 9), f32(4, 3, 3, 3)
    m = node_model("Conv", {"x": x, "w": w}, pads=[1, 1, 1, 1])
    assert_close(run_kiln(m, {"x": x, "w": w})[0],
                 np.asarray(run_reference(m, {"x": x, "w": w})[0]))
