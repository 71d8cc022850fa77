"""Smoothing (SmoothQuant) of LayerNorm outputs before INT8 matrix products, and the default
calibration (auto calibrator, asymmetric ranges): exactness in float, accuracy on a tensor
with an outlier channel, the cache, and QDQ models written with smoothing against
onnxruntime."""

import numpy as np
import onnx
import pytest
import torch

from kiln.builder import Builder, BuilderConfig
from kiln.cli.main import main as kiln_main
from kiln.engine.engine import load
from kiln.passes.quantize import cache as C
from kiln.passes.quantize.calibrate import AutoCalibrator
from kiln.passes.quantize.smooth import channel_amax, factors

RNG = np.random.default_rng(0)
D = 32


class _Block(torch.nn.Module):
    """LayerNorm whose gain has one outlier channel (as transformers' do), read by a Linear
    and by a residual add, then a GELU MLP."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, 64)
        self.fc2 = torch.nn.Linear(64, D)
        with torch.no_grad():
            self.ln.weight.fill_(1.0)
            self.ln.weight[3] = 25.0  # the outlier channel

    def forward(self, x):
        h = self.ln(x)
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    d = tmp_path_factory.mktemp("smooth")
    torch.manual_seed(0)
    path = d / "block.onnx"
    torch.onnx.export(_Block().eval(), (torch.randn(2, 16, D),), str(path), input_names=["x"],
                      output_names=["y"], dynamo=False)
    calib = d / "calib"
    calib.mkdir()
    for i in range(4):
        np.savez(calib / f"b{i}.npz", x=np.random.default_rng(i).standard_normal(
            (2, 16, D)).astype(np.float32))
    return d, path, calib


def _feeds(seed=7):
    return {"x": np.random.default_rng(seed).standard_normal((2, 16, D)).astype(np.float32)}


def _run(engine):
    return engine.create_context().run(_feeds())["y"]


def _err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_factors_are_smoothquant_alpha():
    x_amax = np.array([4.0, 1.0, 0.0])
    w = np.array([[1.0, -0.5], [0.25, 0.0], [2.0, 1.0]], np.float32)  # [K, N]

    class R:  # a reader with a constant weight
        op = type("op", (), {"name": "MatMul"})
        inputs = [None, type("v", (), {"const": w})]

    m = factors(x_amax, [R()], 0.5)
    # c = amax(x)^0.5 / amax(w row)^0.5; m = 1 / c; a zero-range channel stays 1
    np.testing.assert_allclose(m, [1 / np.sqrt(4.0 / 1.0), 1 / np.sqrt(1.0 / 0.25), 1.0])
    np.testing.assert_array_equal(channel_amax(np.array([[[1, -3], [2, 0.5]]], np.float32)),
                                  [2, 3])


def test_smoothing_is_exact_in_float(block):
    """Pinning the smoothed layers to FP32 leaves the Mul and the rescaled weight: the same
    function as the FP32 engine."""
    _, path, calib = block
    logs = []
    e = Builder(BuilderConfig(int8=True, calib=str(calib),
                              layer_precision={"/fc1/MatMul": "fp32", "/fc2/MatMul": "fp32"}),
                log=logs.append).build(path)
    assert any("1 activation(s) smoothed" in m for m in logs)
    np.testing.assert_allclose(_run(e), _run(Builder(BuilderConfig()).build(path)),
                               rtol=1e-4, atol=1e-4)


def test_smoothing_helps_an_outlier_channel(block):
    _, path, calib = block
    ref = _run(Builder(BuilderConfig()).build(path))
    plain = _run(Builder(BuilderConfig(int8=True, calib=str(calib),
                                       int8_smoothing=0.0)).build(path))
    smooth = _run(Builder(BuilderConfig(int8=True, calib=str(calib))).build(path))
    assert _err(smooth, ref) < 0.7 * _err(plain, ref)


def test_cache_carries_smoothing(block, tmp_path):
    _, path, calib = block
    cache = tmp_path / "b.cache"
    timing = str(tmp_path / "timing.json")  # one tactic per layer in both builds: their
    # INT8 GEMM is timed at build (FBGEMM or oneDNN), and a pick that flips under load
    # would change the last bits of the output
    first = _run(Builder(BuilderConfig(int8=True, calib=str(calib), calib_cache=str(cache),
                                       timing_cache=timing)).build(path))
    text = cache.read_text()
    assert text.startswith("TRT-8601-AutoCalibrationAsymmetricSmoothed\n")
    m = C.read_smoothing(cache)
    assert len(m) == 1 and next(iter(m.values())).shape == (D,)
    again = Builder(BuilderConfig(int8=True, calib_cache=str(cache),
                                  timing_cache=timing)).build(path)
    np.testing.assert_array_equal(_run(again), first)


def test_quantize_with_smoothing_runs_in_onnxruntime(block, tmp_path):
    """``kiln quantize`` writes the smoothing as a Mul before the Q/DQ pair: onnxruntime runs
    the file, and kiln builds it back to the engine it quantized."""
    ort = pytest.importorskip("onnxruntime")
    _, path, calib = block
    cache, qdq = tmp_path / "c.cache", tmp_path / "b.qdq.onnx"
    assert kiln_main(["build", str(path), "--int8", "--calib", str(calib), "--calib-cache",
                      str(cache), "-o", str(tmp_path / "a.kiln")]) == 0
    assert kiln_main(["quantize", str(path), "--calib-cache", str(cache), "-o", str(qdq)]) == 0
    ops = [n.op_type for n in onnx.load(str(qdq)).graph.node]
    assert ops.count("QuantizeLinear") == 2 and "Mul" in ops
    assert kiln_main(["build", str(qdq), "-o", str(tmp_path / "b.kiln")]) == 0
    direct, from_qdq = _run(load(tmp_path / "a.kiln")), _run(load(tmp_path / "b.kiln"))
    by_ort = ort.InferenceSession(str(qdq)).run(None, _feeds())[0]
    assert _err(from_qdq, direct) < 1e-4
    assert _err(by_ort, from_qdq) < 1e-2  # onnxruntime's int8 arithmetic, rounding aside


def test_auto_calibrator_minmax_for_matmul_inputs_entropy_else():
    x = RNG.standard_normal(100_000).astype(np.float32)
    x[0] = 40.0  # one outlier
    c = AutoCalibrator()
    c.minmax_names = {"mm_in"}
    c.collect("mm_in", x)
    c.collect("conv_in", x)
    a = c.amax()
    assert a["mm_in"] == 40.0
    assert 2.0 < a["conv_in"] < 10.0  # the entropy threshold clips the outlier
