"""qgemm.c, kiln's u8 x s8 integer GEMM: every path this CPU runs (the scalar loop, AVX2's
vpmaddwd, AVX512-VNNI's vpdpbusd) against a numpy int64 reference on odd shapes, codes at the
ends of their ranges (where an int16 pair sum would saturate), one and per-column scales, a
bias, and row strides; the fused DynamicQuantizeLinear in front against onnxruntime's steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")

PATHS = ["scalar", "avx2", "vnni"]
SHAPES = [(1, 5, 3), (7, 33, 9), (49, 70, 17), (4, 4, 32), (13, 1, 40), (130, 257, 65)]


def _ref(a, zero, scale, wq, ws, bias):
    acc = (a.astype(np.int64) @ wq.astype(np.int64)) - zero * wq.astype(np.int64).sum(0)
    s = (np.float32(scale) * ws.astype(np.float32)).astype(np.float32)
    y = acc.astype(np.int32).astype(np.float32) * s
    return y if bias is None else (y + bias).astype(np.float32)


def _need(path):
    if path not in native.qgemm_paths():
        pytest.skip(f"this CPU has no {path} path")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_qgemm_matches_int_reference(path, m, k, n):
    _need(path)
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    wq = rng.integers(-128, 128, (k, n)).astype(np.int8)
    a[0, :] = 255  # 255 * -128 pairs: an int16 pair sum saturates, the int32 one must not
    wq[:, 0] = -128
    ws = rng.uniform(0.001, 0.02, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    w = native.QGemmWeight(torch.from_numpy(wq), path)
    for zero, per_col, b in ((0, True, None), (131, True, bias), (255, False, bias)):
        wst = torch.from_numpy(ws if per_col else ws[:1].copy())
        got = native.qgemm(torch.from_numpy(a), zero, 0.05, w, wst,
                           None if b is None else torch.from_numpy(b)).numpy()
        want = _ref(a, zero, 0.05, wq, ws if per_col else ws[:1], b)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", PATHS)
def test_qgemm_reads_a_row_stride(path):
    _need(path)
    rng = np.random.default_rng(3)
    big = torch.from_numpy(rng.integers(0, 256, (9, 40)).astype(np.uint8))
    a = big[:, 3:30]  # rows 40 apart, 27 codes each
    wq = rng.integers(-128, 128, (27, 11)).astype(np.int8)
    ws = np.full(1, 0.01, np.float32)
    got = native.qgemm(a, 7, 0.1, native.QGemmWeight(torch.from_numpy(wq), path),
                       torch.from_numpy(ws)).numpy()
    np.testing.assert_array_equal(got, _ref(a.numpy(), 7, 0.1, wq, ws, None))


def test_paths_agree_and_bad_input_is_named():
    rng = np.random.default_rng(4)
    a = torch.from_numpy(rng.integers(0, 256, (49, 99)).astype(np.uint8))
    wq = torch.from_numpy(rng.integers(-128, 128, (99, 23)).astype(np.int8))
    ws = torch.full((23,), 0.003)
    outs = [native.qgemm(a, 100, 0.02, native.QGemmWeight(wq, p), ws)
            for p in native.qgemm_paths()]
    for y in outs[1:]:
        assert torch.equal(y, outs[0])
    with pytest.raises(ValueError, match="path 'sse'"):
        native.QGemmWeight(wq, "sse")
    with pytest.raises(ValueError, match="int8 CPU"):
        native.QGemmWeight(wq.float())
    with pytest.raises(ValueError, match=r"uint8 codes \[M, 99\]"):
        native.qgemm(a[:, :50], 0, 1.0, native.QGemmWeight(wq), ws)


@pytest.mark.parametrize("path", PATHS)
def test_dynamic_qgemm_matches_onnxruntime_steps(path):
    _need(path)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 45)).astype(np.float32)
    wq = rng.integers(-128, 128, (45, 10)).astype(np.int8)
    ws = rng.uniform(0.001, 0.02, 10).astype(np.float32)
    codes, scale, zero = native.dynamic_quantize(torch.from_numpy(x))
    want = _ref(codes.numpy(), int(zero), float(scale), wq, ws, None)
    got = native.dynamic_qgemm(torch.from_numpy(x), native.QGemmWeight(torch.from_numpy(wq), path),
                               torch.from_numpy(ws)).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", PATHS)
def test_qgemm_epilogue_residual_and_activation(path):
    """bias, then the residual, then the activation, on the exact dequantized products; the
    right edge (N not a multiple of 8) through the masked loads and stores."""
    _need(path)
    rng = np.random.default_rng(6)
    m, k, n = 11, 37, 21
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    wq = rng.integers(-128, 128, (k, n)).astype(np.int8)
    ws = rng.uniform(0.001, 0.02, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    big = rng.standard_normal((m, n + 5)).astype(np.float32)
    r = torch.from_numpy(big)[:, 2:2 + n]  # rows n + 5 apart
    w = native.QGemmWeight(torch.from_numpy(wq), path)
    base = _ref(a, 17, 0.03, wq, ws, bias) + r.numpy()
    got = native.qgemm(torch.from_numpy(a), 17, 0.03, w, torch.from_numpy(ws),
                       torch.from_numpy(bias), r, "Relu").numpy()
    np.testing.assert_array_equal(got, np.maximum(base, 0))
    got = native.qgemm(torch.from_numpy(a), 17, 0.03, w, torch.from_numpy(ws),
                       torch.from_numpy(bias), r, "Gelu").numpy()
    want = torch.nn.functional.gelu(torch.from_numpy(base)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    out = torch.full((m, n + 3), 7.0)
    native.qgemm(torch.from_numpy(a), 17, 0.03, w, torch.from_numpy(ws), out=out[:, 1:1 + n])
    np.testing.assert_array_equal(out[:, 1:1 + n].numpy(), _ref(a, 17, 0.03, wq, ws, None))
    assert (out[:, 0] == 7).all() and (out[:, 1 + n:] == 7).all()  # nothing past the edge
    with pytest.raises(ValueError, match="activation 'Swish'"):
        native.qgemm(torch.from_numpy(a), 0, 1.0, w, torch.from_numpy(ws), activation="Swish")


@pytest.mark.parametrize("path", PATHS)
def test_qgemm_requant_matches_qlinear_steps(path):
    """QACT_REQUANT: the int32 products times the whole multiplier, rounded half to even,
    offset, saturated and dequantized: kiln's requantize_ over the exact products."""
    _need(path)
    rng = np.random.default_rng(7)
    m, k, n = 9, 50, 19
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    wq = rng.integers(-128, 128, (k, n)).astype(np.int8)
    mult = rng.uniform(1e-4, 3e-3, n).astype(np.float32)
    w = native.QGemmWeight(torch.from_numpy(wq), path)
    for signed, zero in ((1, -3), (0, 120)):
        lo, hi = (-128, 127) if signed else (0, 255)
        acc = (a.astype(np.int64) @ wq.astype(np.int64)) - 40 * wq.astype(np.int64).sum(0)
        want = native.requantize_(torch.from_numpy(acc.astype(np.float32)),
                                  torch.from_numpy(mult), 0.05, zero, lo, hi).numpy()
        got = native.qgemm(torch.from_numpy(a), 40, 123.0, w, torch.from_numpy(mult),
                           requant=(0.05, zero, lo, hi)).numpy()
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="requant takes no bias"):
        native.qgemm(torch.from_numpy(a), 0, 1.0, w, torch.from_numpy(mult),
                     torch.from_numpy(mult), requant=(1.0, 0, 0, 255))


@pytest.mark.parametrize("path", PATHS)
def test_qgemm_f32_quantizes_rows_as_onnx(path):
    """Float rows (a row stride wider than K) quantized in C: static codes those of
    QuantizeLinear's steps, dynamic ones those of DynamicQuantizeLinear over the whole tensor."""
    _need(path)
    rng = np.random.default_rng(8)
    m, k, n = 13, 29, 10
    big = torch.from_numpy(rng.standard_normal((m, k + 4)).astype(np.float32))
    x = big[:, 1:1 + k]
    wq = rng.integers(-128, 128, (k, n)).astype(np.int8)
    ws = rng.uniform(0.001, 0.02, n).astype(np.float32)
    w = native.QGemmWeight(torch.from_numpy(wq), path)
    codes = torch.clamp(torch.round(x / np.float32(0.02)) + 100, 0, 255).to(torch.uint8)
    got = native.qgemm_f32(x, 0.02, 100, w, torch.from_numpy(ws)).numpy()
    np.testing.assert_array_equal(got, _ref(codes.numpy(), 100, 0.02, wq, ws, None))
    dc, scale, zero = native.dynamic_quantize(x.contiguous())
    got = native.qgemm_f32(x, 0.0, 0, w, torch.from_numpy(ws)).numpy()
    np.testing.assert_array_equal(got, _ref(dc.numpy(), int(zero), float(scale), wq, ws, None))
    with pytest.raises(ValueError, match=r"float32 CPU rows \[M, 29\]"):
        native.qgemm_f32(x.double(), 0.0, 0, w, torch.from_numpy(ws))
