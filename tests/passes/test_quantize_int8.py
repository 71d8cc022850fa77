"""INT8 builds: kernels against NumPy, calibration end to end, pins, fallbacks, the NaN/Inf
check, and QDQ models written by ``kiln quantize`` against onnxruntime."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.builder import Builder, BuilderConfig
from kiln.cli.main import main as kiln_main
from kiln.engine.engine import load
from kiln.errors import KilnError
from kiln.ir import DType, Graph, Node, TensorType, Value
from kiln.kernels.registry import Call
from kiln.kernels.torch import int8 as K
from kiln.ops import int8 as I8
from kiln.passes.quantize.data import load_batches
from kiln.passes.quantize.int8 import W_LEVELS, quantize_weight, scales_from_amax
from tests.ort_util import calibration_reader

RNG = np.random.default_rng(0)


def _call(op, **attrs):
    return Call(op.make_attrs(**attrs), 1, 5)


def _reference_matmul(x, wq, ws, b, s, z, act=None):
    codes = np.clip(np.rint(x / s) + z, 0, 255) - z  # what the layer sees of x
    acc = codes.astype(np.int64) @ wq.astype(np.int64)  # exact int accumulation
    y = acc * (s * ws) + (0 if b is None else b)
    return np.maximum(y, 0) if act == "Relu" else y


@pytest.mark.parametrize("act,with_bias,zero", [("", True, 128), ("Relu", False, 128),
                                                ("", True, 40)])
def test_int8_matmul_matches_numpy(act, with_bias, zero):
    x = RNG.standard_normal((2, 5, 48)).astype(np.float32)
    w = RNG.standard_normal((48, 24)).astype(np.float32)
    wq, ws = quantize_weight(w, 1)
    b = RNG.standard_normal(24).astype(np.float32) if with_bias else None
    s = float(np.abs(x).max() / 127)
    args = [torch.from_numpy(x), torch.from_numpy(wq), torch.from_numpy(ws)]
    args += [torch.from_numpy(b)] if with_bias else []
    call = _call(I8.Int8MatMul, x_scale=s, x_zero=zero, activation=act)
    want = _reference_matmul(x, wq, ws, b, s, zero, act)
    got = K.int8_matmul(call, *args).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    emulated = K._int8_matmul_emulated(call, *args, *([None] * (5 - len(args))))
    np.testing.assert_allclose(emulated.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_int8_matmul_residual_before_activation():
    x = RNG.standard_normal((6, 16)).astype(np.float32)
    wq, ws = quantize_weight(RNG.standard_normal((16, 8)).astype(np.float32), 1)
    r = RNG.standard_normal((6, 8)).astype(np.float32)
    s = float(np.abs(x).max() / 127)
    call = _call(I8.Int8MatMul, x_scale=s, x_zero=128, activation="Relu", has_residual=1)
    got = K.int8_matmul(call, *map(torch.from_numpy, (x, wq, ws)), None, torch.from_numpy(r))
    want = np.maximum(_reference_matmul(x, wq, ws, None, s, 128) + r, 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_int8_conv_matches_emulation():
    x = torch.randn(2, 4, 9, 9)
    wq, ws = quantize_weight(RNG.standard_normal((6, 4, 3, 3)).astype(np.float32), 0)
    b = torch.randn(6)
    s = float(x.abs().max() / 127)
    call = Call(I8.Int8Conv.make_attrs(x_scale=s, x_zero=128, pads=(1, 1, 1, 1),
                                       strides=(2, 2), activation="Relu"), 1, 5)
    args = (x, torch.from_numpy(wq), torch.from_numpy(ws), b)
    got = K.int8_conv(call, *args)
    want = K._int8_conv_emulated(call, *args, None)
    torch.testing.assert_close(got.contiguous(), want, rtol=1e-4, atol=1e-4)


def test_weight_quantization_per_channel():
    w = np.array([[1.0, -0.5], [-2.0, 0.25]], np.float32)  # channels are columns (axis 1)
    q, s = quantize_weight(w, 1)
    np.testing.assert_allclose(s, [2.0 / W_LEVELS, 0.5 / W_LEVELS])
    assert q[1, 0] == -W_LEVELS and q[0, 1] == -W_LEVELS


def test_scales_symmetric_and_one_sided():
    sym = scales_from_amax({"a": 12.7})
    assert sym["a"] == pytest.approx((0.1, 128))
    asym = scales_from_amax({"a": 10.0, "b": 5.0}, {"a": -0.17, "b": -9.0}, {"a": 10.0, "b": 4.0})
    s, z = asym["a"]
    assert s == pytest.approx(10.17 / 255) and z == round(0.17 / s)
    s, z = asym["b"]  # [-9, 4] clipped to amax 5: [-5, 4]
    assert s == pytest.approx(9.0 / 255) and z == round(5.0 / s)


# ---------------------------------------------------------------- whole builds


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8 * 8 * 8, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        y = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(y)))


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    d = tmp_path_factory.mktemp("int8")
    torch.manual_seed(0)
    path = d / "net.onnx"
    torch.onnx.export(_Net().eval(), (torch.randn(4, 3, 8, 8),), str(path), input_names=["x"],
                      output_names=["y"], dynamo=False)
    calib = d / "calib"
    calib.mkdir()
    for i in range(4):
        np.savez(calib / f"b{i}.npz", x=np.random.default_rng(i).standard_normal(
            (4, 3, 8, 8)).astype(np.float32))
    return d, path, calib


def _feeds(seed=9):
    return {"x": np.random.default_rng(seed).standard_normal((4, 3, 8, 8)).astype(np.float32)}


def _run(engine, feeds=None):
    return engine.create_context().run(feeds or _feeds())["y"]


def test_build_int8_close_to_fp32(net):
    _, path, calib = net
    logs = []
    b = Builder(BuilderConfig(int8=True, calib=str(calib)), log=logs.append)
    e = b.build(path)
    kinds = sorted(set(e.choices.values()))
    assert "TorchInt8Conv" in kinds and "TorchInt8MatMul" in kinds
    assert len(b.report["int8"]["int8"]) == 3
    ref = _run(Builder(BuilderConfig()).build(path))
    got = _run(e)
    cos = (got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref)
    assert cos > 0.99 and not np.allclose(got, ref, atol=1e-6)  # quantized, and close
    assert any("NaN/Inf check: every layer" in m for m in logs)


def test_build_int8_layer_precision_pins(net):
    _, path, calib = net
    logs = []
    cfg = BuilderConfig(int8=True, calib=str(calib), layer_precision={"/fc2/Gemm": "fp32"})
    e = Builder(cfg, log=logs.append).build(path)
    assert e.choices["/fc2/Gemm"] != "TorchInt8MatMul"
    assert any("'/fc2/Gemm' kept in float: pinned by --layer-precision" in m for m in logs)


def test_build_int8_needs_calibration(net):
    _, path, _ = net
    with pytest.raises(KilnError, match="--int8 needs calibration data"):
        Builder(BuilderConfig(int8=True)).build(path)


def test_build_int8_cache_written_then_used(net, tmp_path):
    _, path, calib = net
    cache = tmp_path / "net.cache"
    # TensorRT's own cache; one timing cache, so both builds mostly take the same timed
    # tactics. The outputs are compared to float rounding, not bit for bit: a float layer's
    # pick or its first run's kernel (traced vs native program) can still change the last
    # bits (CI saw 2e-6 relative); a scale not read back would be off by 1e-3 and more
    trt = dict(calibrator="entropy", int8_asymmetric=False,
               timing_cache=str(tmp_path / "timing.json"))
    first = _run(Builder(BuilderConfig(int8=True, calib=str(calib),
                                       calib_cache=str(cache), **trt)).build(path))
    assert cache.read_text().startswith("TRT-8601-EntropyCalibration2\n")
    logs = []
    again = Builder(BuilderConfig(int8=True, calib_cache=str(cache), **trt),
                    log=logs.append).build(path)
    assert any("scales read from" in m for m in logs)
    np.testing.assert_allclose(_run(again), first, rtol=1e-5, atol=1e-6)
    with pytest.raises(KilnError, match="not MinMaxCalibration"):
        Builder(BuilderConfig(int8=True, calib_cache=str(cache), calibrator="minmax",
                              int8_asymmetric=False)).build(path)
    with pytest.raises(KilnError, match="not AutoCalibrationAsymmetric"):  # the defaults
        Builder(BuilderConfig(int8=True, calib_cache=str(cache))).build(path)


def test_cli_build_int8_and_qdq_round_trip(net, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    _, path, calib = net
    cache, qdq = tmp_path / "c.cache", tmp_path / "net.qdq.onnx"
    assert kiln_main(["build", str(path), "--int8", "--calib", str(calib), "--calib-cache",
                      str(cache), "-o", str(tmp_path / "a.kiln")]) == 0
    assert kiln_main(["quantize", str(path), "--calib-cache", str(cache), "-o", str(qdq)]) == 0
    ops = [n.op_type for n in onnx.load(str(qdq)).graph.node]
    assert ops.count("QuantizeLinear") == 3 and ops.count("DequantizeLinear") == 6
    assert kiln_main(["build", str(qdq), "-o", str(tmp_path / "b.kiln")]) == 0
    direct = _run(load(tmp_path / "a.kiln"))
    from_qdq = _run(load(tmp_path / "b.kiln"))
    by_ort = ort.InferenceSession(str(qdq)).run(None, _feeds())[0]
    np.testing.assert_allclose(from_qdq, direct, atol=1e-5)  # the same engine back
    np.testing.assert_allclose(by_ort, from_qdq, atol=1e-4)


def _relu_net_with_overflow(tmp_path):
    """y = MatMul(Mul(x, 1e30) -> ...): FP16 overflows to Inf in the Mul."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    big = numpy_helper.from_array(np.array(1e6, np.float32), "big")
    nodes = [helper.make_node("Mul", ["x", "big"], ["h"], name="scale_up"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                          [w, big])
    path = tmp_path / "overflow.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_fp16_build_names_first_nonfinite_layer(tmp_path):
    path = _relu_net_with_overflow(tmp_path)
    logs = []
    b = Builder(BuilderConfig(fp16=True, calib=[{"x": np.full((2, 4), 1.0, np.float32)}]),
                log=logs.append)
    b.build(path)
    assert b.report["nonfinite"][0] == "scale_up"
    assert any("layer 'scale_up' outputs NaN or Inf" in m for m in logs)


def test_fp16_check_accepts_inf_that_stays_inside(tmp_path):
    """Where(mask, -inf, x) -> Softmax, as attention masks are written: the -inf is by design
    and the outputs are finite, so no warning; the check still names a NaN's layer."""
    nodes = [helper.make_node("Where", ["m", "ninf", "x"], ["s"], name="mask_fill"),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
             helper.make_node("Sub", ["p", "p"], ["z"], name="zero"),
             helper.make_node("Div", ["z", "z"], ["q"], name="nan_maker"),
             helper.make_node("Add", ["p", "q"], ["y"], name="out")]
    ninf = numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf")
    g = helper.make_graph(
        nodes[:2], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                         helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 4])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, 4])], [ninf])
    path = tmp_path / "mask.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    feeds = {"x": np.ones((2, 4), np.float32),
             "m": np.array([[True, False, False, False]] * 2)}
    logs = []
    b = Builder(BuilderConfig(fp16=True, calib=[feeds]), log=logs.append)
    b.build(path)
    assert b.report["nonfinite"] is None
    assert any("every layer's output is finite" in m or "Inf" in m for m in logs)

    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                     helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [ninf])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    b = Builder(BuilderConfig(fp16=True, calib=[feeds]), log=logs.append)
    b.build(path)
    assert b.report["nonfinite"] is not None and "nan_maker" in b.report["nonfinite"][0]


def test_calibration_data_errors(tmp_path):
    with pytest.raises(KilnError, match="no such file"):
        load_batches(tmp_path / "nope", ["x"])
    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(KilnError, match=".npy batches need a model with one input"):
        load_batches(tmp_path, ["x", "y"])
    with pytest.raises(KilnError, match="missing y; unknown z"):
        load_batches([{"x": 1, "z": 2}], ["x", "y"])
    (tmp_path / "gen.py").write_text("import numpy as np\n"
                                     "def batches():\n    yield {'x': np.ones(2)}\n")
    assert load_batches(tmp_path / "gen.py", ["x"])[0]["x"].tolist() == [1.0, 1.0]


def test_int8_graph_types():
    g = Graph()
    x = Value("x", TensorType(DType.float32, (2, 4)))
    g.inputs = [x]
    wq = g.add_weight("wq", np.ones((4, 3), np.int8), TensorType(DType.int8, (4, 3)))
    ws = g.add_weight("ws", np.ones(3, np.float32), TensorType(DType.float32, (3,)))
    y = Value("y", TensorType(DType.float32, (2, 3)))
    n = Node(I8.Int8MatMul, "mm", [x, wq, ws], [y], I8.Int8MatMul.make_attrs(x_scale=0.1))
    from kiln.ir import InferCtx
    ctx = InferCtx(n.attrs, [v.type for v in n.inputs], [None, wq.const, ws.const],
                   [None] * 3, 1)
    (t,) = I8.Int8MatMul.infer(ctx)
    assert t.dtype is DType.float32 and tuple(t.shape) == (2, 3)


def test_cuda_int8_kernel_arithmetic_on_cpu(monkeypatch):
    """The CUDA kernel's signed-code trick (c - 128, plus (128 - z) * colsum(W) for an
    asymmetric zero point) on CPU tensors, where torch._int_mm runs too."""
    from kiln.kernels.torch import low_bit_cuda as L

    monkeypatch.setattr(L, "_int_mm_ok", lambda x2, wq: True)
    x = RNG.standard_normal((32, 64)).astype(np.float32)
    wq, ws = quantize_weight(RNG.standard_normal((64, 16)).astype(np.float32), 1)
    for zero in (128, 30):
        s = float(np.abs(x).max() / 127)
        call = _call(I8.Int8MatMul, x_scale=s, x_zero=zero)
        got = L.cuda_int8_matmul(call, *map(torch.from_numpy, (x, wq, ws)))
        want = _reference_matmul(x, wq, ws, None, s, zero)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_fp8_matmul_emulation_matches_ml_dtypes():
    import ml_dtypes

    from kiln.kernels.torch import low_bit_cuda as L
    from kiln.passes.quantize.int8 import quantize_weight_fp8

    x = RNG.standard_normal((4, 32)).astype(np.float32)
    w = RNG.standard_normal((32, 8)).astype(np.float32)
    wf8, ws = quantize_weight_fp8(w)
    s = float(np.abs(x).max() / 448)
    call = _call(I8.Fp8MatMul, x_scale=s)
    got = L.fp8_matmul(call, torch.from_numpy(x), torch.from_numpy(wf8.view(np.uint8)).view(
        torch.float8_e4m3fn), torch.from_numpy(ws))
    xq = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    want = xq @ (wf8.astype(np.float32) * ws)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - x @ w).max() < 0.1 * np.abs(x @ w).max()  # FP8 is close, not exact


def test_build_fp8_saves_and_loads(net, tmp_path):
    _, path, calib = net
    b = Builder(BuilderConfig(fp8=True, calib=str(calib)))
    e = b.build(path)
    assert sorted(set(e.choices.values()) & {"TorchFp8MatMul", "TorchInt8Conv"}) == [
        "TorchFp8MatMul"]
    assert list(b.report["int8"]["float"].values()) == ["no FP8 convolution kernel"]
    e.save(tmp_path / "f.kiln")
    ref = _run(Builder(BuilderConfig()).build(path))
    got = _run(load(tmp_path / "f.kiln"))
    assert (got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref) > 0.98


def test_quantize_dynamic_model_runs_int8_layers(tmp_path):
    """onnxruntime's quantize_dynamic output (DynamicQuantizeLinear + MatMulInteger + Cast +
    Mul) becomes Int8MatMul layers quantizing per call, on the model's own weight codes (not
    rounded again onto kiln's 7-bit grid): onnxruntime's outputs to float rounding."""
    ort = pytest.importorskip("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    src, dyn = tmp_path / "mlp.onnx", tmp_path / "mlp.dyn.onnx"
    torch.onnx.export(mlp.eval(), (torch.randn(2, 8, 32),), str(src), input_names=["x"],
                      output_names=["y"], dynamo=False)
    quantize_dynamic(str(src), str(dyn), weight_type=QuantType.QInt8)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(dyn)
    assert list(e.choices.values()).count("TorchInt8MatMul") == 2
    assert not any(k in ("TorchMatMulInteger", "TorchDynamicQuantizeLinear")
                   for k in e.choices.values())
    assert any("2 MatMulInteger layer(s) made INT8 layers" in m for m in logs)
    x = {"x": np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)}
    got = e.create_context().run(x)["y"]
    want = ort.InferenceSession(str(dyn)).run(None, x)[0]
    fp32 = mlp(torch.from_numpy(x["x"])).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # as far from FP32 as onnxruntime's own INT8 arithmetic is, no further
    assert np.abs(got - fp32).max() <= 1.01 * np.abs(want - fp32).max() + 1e-6


def _pair_saturated(codes_u8, wq):
    """u8 x s8 products summed in int16 pairs (k = 2j, 2j + 1) with saturation, then in int32:
    what AVX2's vpmaddubsw does, in onnxruntime's MLAS and in FBGEMM alike."""
    p = codes_u8.astype(np.int64)[:, :, None] * wq.astype(np.int64)[None]
    m, k, n = p.shape
    return np.clip(p.reshape(m, k // 2, 2, n).sum(2), -32768, 32767).sum(1)


@pytest.mark.skipif(not K._HAS_FBGEMM, reason="needs PyTorch's FBGEMM")
def test_int8_matmul_fbgemm_full_range_weights_saturate_as_mlas():
    """Full-range (+-127) weights: FBGEMM's integers are the pairwise-saturated sums, the ones
    onnxruntime computes on AVX2 without VNNI, and the exact ones with VNNI (both there); on
    kiln's 7-bit weights nothing saturates (exact)."""
    x = (RNG.standard_normal((16, 64)) * 3).astype(np.float32)
    wq = RNG.integers(-127, 128, (64, 32)).astype(np.int8)
    ws = np.full(32, 0.01, np.float32)
    s, z = float(np.abs(x).max() / 127), 128
    call = _call(I8.Int8MatMul, x_scale=s, x_zero=z)
    got = K.int8_matmul(call, *map(torch.from_numpy, (x, wq, ws))).numpy()
    codes = np.clip(np.rint(x / s) + z, 0, 255)
    acc = _pair_saturated(codes, wq) if K.u8s8_saturates() else \
        codes.astype(np.int64) @ wq.astype(np.int64)
    want = (acc - z * wq.astype(np.int64).sum(0)) * (s * ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_quantize_weight_keeps_a_models_own_grid():
    """A weight dequantized from an onnxruntime-quantized model (per-tensor or per-column
    scales, codes up to +-127) keeps its codes and scales; a weight on no known grid goes to
    kiln's 7-bit grid; columns mix freely (a merged Q/K/V weight)."""
    codes = RNG.integers(-127, 128, (40, 6)).astype(np.int8)
    codes[0, :3] = 127  # per-column scales have a column maximum of 127 ...
    scales = np.array([0.02, 0.03, 0.011, 0.005, 0.005, 0.005], np.float32)
    codes[:, 3:] = np.clip(codes[:, 3:], -90, 90)  # ... a per-tensor one need not
    w = codes.astype(np.float32) * scales
    w[:, 5] = RNG.standard_normal(40).astype(np.float32)  # on no grid
    from kiln.passes.quantize.int8 import weight_grids  # noqa: F401 (used by the builder)
    q, s = quantize_weight(w, 1, grid=np.array([0.005, 0.011, 0.02, 0.03], np.float32))
    np.testing.assert_array_equal(q[:, :5], codes[:, :5])
    np.testing.assert_array_equal(s[:5], scales[:5])
    assert np.abs(q[:, 5]).max() == W_LEVELS
    q0, _ = quantize_weight(w, 1)
    assert np.abs(q0).max() <= W_LEVELS  # without a grid: kiln's own


class _QOpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 4, 3, padding=1)
        self.fc1 = torch.nn.Linear(64, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x):  # [2, 3, 8, 8]; the Linears see [2, 4, 64] (MatMul + Add)
        y = self.conv2(torch.relu(self.conv1(x))).flatten(2)
        return self.fc2(torch.relu(self.fc1(y)))


def _qoperator_model(tmp_path):
    """onnxruntime's quantize_static of :class:`_QOpNet` in QOperator format: 2 QLinearConv and
    2 QLinearMatMul between QuantizeLinear/DequantizeLinear; (file, net, inputs)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    torch.manual_seed(0)
    src, qop = tmp_path / "n.onnx", tmp_path / "n.qop.onnx"
    net = _QOpNet().eval()
    torch.onnx.export(net, (torch.randn(2, 3, 8, 8),), str(src),
                      input_names=["x"], output_names=["y"], dynamo=False)
    reader = calibration_reader([{"x": np.random.default_rng(i).standard_normal(
        (2, 3, 8, 8)).astype(np.float32)} for i in range(4)])
    quantize_static(str(src), str(qop), reader, quant_format=QuantFormat.QOperator,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=["Conv", "MatMul"])
    ops = [n.op_type for n in onnx.load(str(qop)).graph.node]
    assert ops.count("QLinearConv") == 2 and ops.count("QLinearMatMul") == 2
    x = {"x": np.random.default_rng(9).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    return qop, net, x


def test_qoperator_model_runs_int8_layers(tmp_path):
    """With ``qlinear_conv_int8`` every QLinear layer becomes a kiln INT8 layer on the model's
    own weight codes. Their outputs differ in the int16 saturation of u8 x s8 pairs on AVX2
    (onnxruntime's MLAS and oneDNN's convolutions saturate differently; on this net most of
    both runtimes' error to FP32 is saturation) and in the convolutions' two roundings:
    kiln stays about as close to FP32 as onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    qop, net, x = _qoperator_model(tmp_path)
    logs = []
    e = Builder(BuilderConfig(qlinear_conv_int8=True), log=logs.append).build(qop)
    assert any("4 QLinearMatMul/QLinearConv layer(s) in QDQ form" in m for m in logs)
    kinds = list(e.choices.values())
    # the MatMuls requantize their output before the bias Add, as QLinearMatMul does
    assert kinds.count("TorchInt8Conv") == 2 and kinds.count("TorchInt8MatMulQDQ") == 2
    assert not any("QLinear" in k for k in kinds)
    got = e.create_context().run(x)["y"]
    want = ort.InferenceSession(str(qop)).run(None, x)[0]
    fp32 = net(torch.from_numpy(x["x"])).detach().numpy()
    assert (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want) > 0.99
    assert np.abs(got - fp32).max() <= 1.5 * np.abs(want - fp32).max()


def test_qoperator_convs_keep_qlinearconv_steps_by_default(tmp_path):
    """By default (CPU) QLinearConv runs its own steps (exact int32 sums, one requantization
    multiplier), the QLinearMatMuls still become INT8 layers; without int16 saturation in
    onnxruntime's u8 x s8 GEMMs (VNNI, or no AVX2-only path) the output is onnxruntime's
    exactly, where the INT8-conv form rounds a few codes differently."""
    ort = pytest.importorskip("onnxruntime")
    qop, net, x = _qoperator_model(tmp_path)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(qop)
    assert any("2 QLinearMatMul/QLinearConv layer(s) in QDQ form" in m for m in logs)
    kinds = list(e.choices.values())
    assert kinds.count("TorchInt8Conv") == 0 and kinds.count("TorchInt8MatMulQDQ") == 2
    assert sum("QLinearConv" in k for k in kinds) == 2
    got = e.create_context().run(x)["y"]
    want = ort.InferenceSession(str(qop)).run(None, x)[0]
    if K.u8s8_saturates():
        assert (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want) > 0.99
    else:
        np.testing.assert_array_equal(got, want)


def test_qlinearconv_stem_matches_reference_exactly(tmp_path):
    """A ResNet stem as onnxruntime's QOperator quantizer writes it (int8 codes, 3 -> 64
    channels, 7x7 stride 2, at 160x160): kiln's default build gives the ONNX reference's
    codes exactly (its QDQ/INT8-conv form, ``qlinear_conv_int8``, rounds 69 of 409,600
    differently on an AVX-512 VNNI machine)."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(5)
    c, m, size = 3, 64, 160
    inits = [numpy_helper.from_array(np.array(0.0173, np.float32), "xs"),
             numpy_helper.from_array(np.array(-3, np.int8), "xz"),
             numpy_helper.from_array(rng.integers(-127, 128, (m, c, 7, 7)).astype(np.int8), "w"),
             numpy_helper.from_array(rng.uniform(0.001, 0.01, m).astype(np.float32), "ws"),
             numpy_helper.from_array(np.zeros(m, np.int8), "wz"),
             numpy_helper.from_array(np.array(0.0291, np.float32), "ys"),
             numpy_helper.from_array(np.array(5, np.int8), "yz"),
             numpy_helper.from_array(rng.integers(-500, 500, m).astype(np.int32), "b")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                              ["yq"], pads=[3, 3, 3, 3], strides=[2, 2]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    g = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, size // 2, size // 2])],
        inits)
    path = tmp_path / "stem.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    x = {"x": rng.standard_normal((1, c, size, size)).astype(np.float32)}
    want = ReferenceEvaluator(str(path)).run(None, x)[0]
    e = Builder(BuilderConfig()).build(path)
    assert sum("QLinearConv" in k for k in e.choices.values()) == 1
    np.testing.assert_array_equal(e.create_context().run(x)["y"], want)


@pytest.mark.parametrize("requant", [True, False])
def test_qgemm_matches_onnxruntime(tmp_path, requant):
    """com.microsoft QGemm (what onnxruntime's QOperator quantizer writes for a Gemm, e.g. a
    classifier's last Linear): int32 bias, per-column weight scales, transB, alpha; requantized
    to uint8 codes, or float32 out without y_scale/y_zero_point: onnxruntime's values."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(2)
    k, n = 96, 40
    inits = [numpy_helper.from_array(np.array(0.021, np.float32), "as"),
             numpy_helper.from_array(np.array(131, np.uint8), "az"),
             numpy_helper.from_array(rng.integers(-127, 128, (n, k)).astype(np.int8), "b"),
             numpy_helper.from_array(rng.uniform(0.002, 0.02, n).astype(np.float32), "bs"),
             numpy_helper.from_array(np.zeros(n, np.int8), "bz"),
             numpy_helper.from_array(rng.integers(-3000, 3000, n).astype(np.int32), "c"),
             numpy_helper.from_array(np.array(0.37, np.float32), "ys"),
             numpy_helper.from_array(np.array(120, np.uint8), "yz")]
    ins = ["a", "as", "az", "b", "bs", "bz", "c"] + (["ys", "yz"] if requant else [])
    y_type = TensorProto.UINT8 if requant else TensorProto.FLOAT
    g = helper.make_graph(
        [helper.make_node("QGemm", ins, ["y"], domain="com.microsoft", transB=1, alpha=0.75)],
        "qgemm", [helper.make_tensor_value_info("a", TensorProto.UINT8, [7, k])],
        [helper.make_tensor_value_info("y", y_type, [7, n])], inits)
    path = tmp_path / "qgemm.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                  helper.make_opsetid("com.microsoft", 1)]),
              str(path))
    a = {"a": rng.integers(0, 256, (7, k)).astype(np.uint8)}
    want = ort.InferenceSession(str(path)).run(None, a)[0]
    got = Builder(BuilderConfig()).build(path).create_context().run(a)["y"]
    assert got.dtype == want.dtype
    if requant:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_qlinearmatmul_of_two_activations(tmp_path):
    """QLinearMatMul whose both operands are computed in the run (attention's Q Kᵀ in
    onnxruntime's QOperator format): runs (the weight cache must not keep anything made from
    an activation) and gives onnxruntime's codes, on the first run and later ones."""
    ort = pytest.importorskip("onnxruntime")
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z"),
             numpy_helper.from_array(np.array(0.4, np.float32), "ys"),
             numpy_helper.from_array(np.array(100, np.uint8), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("QuantizeLinear", ["t", "s", "z"], ["tq"]),
             helper.make_node("QLinearMatMul", ["xq", "s", "z", "tq", "s", "z", "ys", "yz"],
                              ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    g = helper.make_graph(
        nodes, "qkt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 16]),
                       helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 4, 16, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8, 8])], inits)
    path = tmp_path / "qkt.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    ctx = Builder(BuilderConfig()).build(path).create_context()
    sess = ort.InferenceSession(str(path))
    for seed in range(3):
        rng = np.random.default_rng(seed)
        feeds = {"x": rng.standard_normal((2, 4, 8, 16)).astype(np.float32),
                 "t": rng.standard_normal((2, 4, 16, 8)).astype(np.float32)}
        np.testing.assert_array_equal(ctx.run(feeds)["y"], sess.run(None, feeds)[0])


def _qdq_model(tmp_path, residual: bool):
    """x -> Q/DQ -> MatMul(DQ(Wq)) [-> + the rounded x]: the pair feeds a weight layer, and
    with ``residual`` also an Add that reads the rounded values (as onnxruntime computes)."""
    rng = np.random.default_rng(3)
    wq = rng.integers(-60, 60, (8, 8)).astype(np.int8)
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z"),
             numpy_helper.from_array(wq, "wq"),
             numpy_helper.from_array(np.array(0.02, np.float32), "ws")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
             helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], name="dqw"),
             helper.make_node("MatMul", ["xd", "w"], ["m"], name="mm")]
    if residual:
        nodes.append(helper.make_node("Add", ["m", "xd"], ["y"], name="add"))
    else:
        nodes.append(helper.make_node("Identity", ["m"], ["y"], name="out"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], inits)
    path = tmp_path / f"qdq_{residual}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("residual", [False, True])
def test_qdq_pair_read_by_other_ops_stays(tmp_path, residual):
    ort = pytest.importorskip("onnxruntime")
    path = _qdq_model(tmp_path, residual)
    logs = []
    engine = Builder(BuilderConfig(), log=logs.append).build(str(path))
    folded = [m for m in logs if "Q/DQ pair(s) folded" in m]
    assert folded and (("0 Q/DQ pair(s) folded" in folded[0]) == residual)
    assert ("1 pair(s) feeding other ops kept" in folded[0]) == residual
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32)
    got = engine.create_context().run({"x": x})["y"]
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fp16_nonfinite_check_feeds_valid_token_ids(tmp_path):
    """Without calibration data the check feeds zero integers: random token ids past a
    2-row table (a BERT's token types) would be out of range, which on CUDA is a device-side
    assert that kills the process."""
    table = numpy_helper.from_array(np.ones((2, 4), np.float32), "types")
    g = helper.make_graph(
        [helper.make_node("Gather", ["types", "ids"], ["y"], name="embed")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4])], [table])
    path = tmp_path / "types.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    logs = []
    b = Builder(BuilderConfig(fp16=True), log=logs.append)
    b.build(path)
    assert "nonfinite" in b.report and b.report["nonfinite"] is None
    assert not any("NaN/Inf check: not run" in m for m in logs)


def _dynamic_matmul_model(wq: np.ndarray, wz) -> onnx.ModelProto:
    """DynamicQuantizeLinear + MatMulInteger + Cast + Mul, as quantize_dynamic writes them."""
    k, n = wq.shape
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "W", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"]),
             helper.make_node("Mul", ["accf", "s"], ["y"])]
    g = helper.make_graph(
        nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, n])],
        [numpy_helper.from_array(wq, "W"), numpy_helper.from_array(np.asarray(wz, wq.dtype), "wz"),
         numpy_helper.from_array(np.array(0.01, np.float32), "ws")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _dynamic_reference(x, wq, wz):
    """DynamicQuantizeLinear then exact integer (x - xz) @ (W - wz), scaled back."""
    lo, hi = np.float32(min(x.min(), 0)), np.float32(max(x.max(), 0))
    s = np.float32((hi - lo) / np.float32(255))
    z = np.rint(np.clip(-lo / s, 0, 255))
    codes = np.clip(np.rint(x / s) + z, 0, 255).astype(np.int64) - int(z)
    acc = codes @ (wq.astype(np.int64) - int(wz))
    return acc.astype(np.float32) * (s * np.float32(0.01))


@pytest.mark.parametrize("span,folds", [((0, 256), False), ((119 - 63, 119 + 64), True)])
def test_dynamic_uint8_weights_exact(tmp_path, span, folds):
    """uint8 weights with a zero point (onnxruntime's exact u8 x u8 GEMM): codes minus zero
    point beyond kiln's 7-bit grid keep the exact MatMulInteger (folded, they were rounded onto
    7 bits and saturated: ddddocr's 1.6e-2); codes within it fold into an INT8 layer."""
    rng = np.random.default_rng(3)
    wq = rng.integers(*span, (256, 32)).astype(np.uint8)
    x = (np.abs(rng.standard_normal((16, 256))) * 3).astype(np.float32)  # large codes
    path = tmp_path / "dyn.onnx"
    onnx.save(_dynamic_matmul_model(wq, 119), path)
    e = Builder(BuilderConfig()).build(path)
    assert ("TorchInt8MatMul" in e.choices.values()) == folds
    got = e.create_context().run({"x": x})["y"]
    want = _dynamic_reference(x, wq, 119)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _fma_ties(s: float, z: int, n: int) -> np.ndarray:
    """``n`` float32 values whose code ``round(x / s) + z`` (DynamicQuantizeLinear's) differs
    from ``round(x * (1 / s) + z)`` computed as one fused multiply-add (FBGEMM's quantizer)."""
    rng = np.random.default_rng(5)
    s32, inv = np.float32(s), np.float32(1) / np.float32(s)
    cand = ((rng.integers(-z, 255 - z, 400000) + 0.5) * s32).astype(np.float32)
    cand = np.nextafter(cand, cand + rng.choice([-1, 1], cand.size).astype(np.float32))
    exact = np.rint(cand / s32) + z
    fused = np.rint((cand.astype(np.float64) * np.float64(inv) + z).astype(np.float32))
    picked = cand[exact != fused]
    assert picked.size >= n
    return picked[:n]


def test_dynamic_int8_matmul_codes_as_dynamic_quantize_linear(tmp_path):
    """A dynamic INT8 layer (folded from quantize_dynamic's pattern, int8 weights) sees the
    codes DynamicQuantizeLinear computes, ``round(x / scale) + zero``, also on the values where
    FBGEMM's own ``x * (1 / scale) + zero`` rounds the other way: onnxruntime's integers."""
    rng = np.random.default_rng(4)
    wq = rng.integers(-127, 128, (256, 32)).astype(np.int8)
    x = rng.uniform(-1.0, 3.0, (16, 256)).astype(np.float32)
    x[0, :2] = (-1.0, 3.0)  # the range: scale 4 / 255, zero point 64
    s = np.float32(np.float32(4.0) / np.float32(255))
    x[1:, 7] = _fma_ties(float(s), 64, 15)
    path = tmp_path / "dyn.onnx"
    onnx.save(_dynamic_matmul_model(wq, 0), path)
    e = Builder(BuilderConfig()).build(path)
    assert "TorchInt8MatMul" in e.choices.values()
    got = e.create_context().run({"x": x})["y"]
    want = _dynamic_reference(x, wq, 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _requant_model(wq, sx, sw, sy, k, n):
    """x -> Q/DQ(u8) -> MatMul(DQ(Wq)) -> Q/DQ(s8): onnxruntime's QLinearMatMul."""
    inits = [numpy_helper.from_array(np.array(sx, np.float32), "sx"),
             numpy_helper.from_array(np.array(128, np.uint8), "zx"),
             numpy_helper.from_array(wq, "wq"),
             numpy_helper.from_array(np.array(sw, np.float32), "sw"),
             numpy_helper.from_array(np.array(sy, np.float32), "sy"),
             numpy_helper.from_array(np.array(3, np.int8), "zy")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw"], ["w"]),
             helper.make_node("MatMul", ["xd", "w"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "sy", "zy"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [64, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_int8_matmul_requantizes_as_qlinear_matmul(tmp_path):
    """DQ -> MatMul -> Q/DQ becomes one Int8MatMulQDQ whose codes are onnxruntime's
    QLinearMatMul ones, ``round(acc * (sx * sw / sy))``, to the bit, on data where rounding
    the float product ``acc * (sx * sw)`` again by ``sy`` gives other codes."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(8)
    k, n = 64, 48
    wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
    wq[:, 0] = 0
    wq[:2, 0] = (127, 1)  # column 0: acc = 127 * c0 + c1, any integer within +-16000
    sx, sw = np.float32(1 / 127), np.float32(0.003)
    accs = np.arange(-16000, 16001).astype(np.float32)
    for sy in np.linspace(0.003, 0.004, 1000, dtype=np.float32):  # where they differ
        fused = np.rint(accs * (sx * sw / sy))
        ties = accs[(fused != np.rint((accs * (sx * sw)) / sy)) & (np.abs(fused) < 120)]
        if ties.size >= 2:
            break
    else:
        pytest.fail("no scale found where the two roundings differ")
    x = rng.uniform(-1.0, 1.0, (64, k)).astype(np.float32)
    for row, a in enumerate(ties[:2].astype(np.int64)):
        c0 = int(np.rint(a / 127))
        x[row, :2] = np.array([c0, a - 127 * c0], np.float32) * sx  # codes c0, c1 exactly
    path = tmp_path / "requant.onnx"
    onnx.save(_requant_model(wq, sx, sw, sy, k, n), path)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(path)
    assert "TorchInt8MatMulQDQ" in e.choices.values()
    assert any("1 INT8 layer(s) requantize their output" in m for m in logs)
    got = e.create_context().run({"x": x})["y"]
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert np.array_equal(got, want)
    codes = np.clip(np.rint(x / sx) + 128, 0, 255).astype(np.int64) - 128
    acc0 = (codes @ wq.astype(np.int64))[:2, 0].astype(np.float32)
    assert np.array_equal(acc0, ties[:2])
    q = np.clip(np.rint(acc0 * (sx * sw / sy)) + 3, -128, 127)
    assert np.array_equal(want[:2, 0], ((q - 3) * sy).astype(np.float32))  # the fused rounding


def test_no_fuse_requantize_with_bias():
    """An Int8MatMul with a bias is not what QLinearMatMul computes: no fusion."""
    from kiln.passes.quantize.qdq import fuse_requantize

    g = Graph("g")
    x = Value("x", TensorType(DType.float32, (4, 8)))
    g.inputs.append(x)
    wq = g.add_weight("wq", np.ones((8, 8), np.int8), TensorType(DType.int8, (8, 8)))
    ws = g.add_weight("ws", np.ones(8, np.float32), TensorType(DType.float32, (8,)))
    b = g.add_weight("b", np.ones(8, np.float32), TensorType(DType.float32, (8,)))
    m = Value("m", TensorType(DType.float32, (4, 8)))
    y = Value("y", TensorType(DType.float32, (4, 8)))
    g.nodes += [Node(I8.Int8MatMul, "mm", [x, wq, ws, b], [m],
                     I8.Int8MatMul.make_attrs(x_scale=0.1, x_zero=128)),
                Node(I8.QuantizeDequantize, "qdq", [m], [y],
                     I8.QuantizeDequantize.make_attrs(scale=0.2, zero=0, signed=1))]
    g.outputs.append(y)
    assert fuse_requantize(g) == 0
    assert [nd.op for nd in g.nodes] == [I8.Int8MatMul, I8.QuantizeDequantize]


def _dynamic_conv_model(same_scale: bool = True) -> onnx.ModelProto:
    """DynamicQuantizeLinear -> ConvInteger with the bias and rescale as ddddocr's quantizer
    writes them (the scale product twice; ``same_scale=False``: the rescale by another one)."""
    rng = np.random.default_rng(6)
    w = rng.integers(0, 256, (8, 4, 3, 3)).astype(np.uint8)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.uint8(119), "wz"),
             numpy_helper.from_array(np.array(0.004, np.float32), "ws"),
             numpy_helper.from_array(np.array(0.003, np.float32), "other"),
             numpy_helper.from_array((rng.standard_normal(8) * 0.5).astype(np.float32), "B"),
             numpy_helper.from_array(np.array([1, -1, 1, 1], np.int64), "shape")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("Mul", ["xs", "ws"], ["s1"]),
             helper.make_node("Mul", ["xs", "ws" if same_scale else "other"], ["s2"]),
             helper.make_node("Div", ["B", "s1"], ["bd"]),
             helper.make_node("Floor", ["bd"], ["bf"]),
             helper.make_node("Cast", ["bf"], ["bi"], to=TensorProto.INT32),
             helper.make_node("Reshape", ["bi", "shape"], ["br"]),
             helper.make_node("ConvInteger", ["xq", "W", "xz", "wz"], ["acc"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["acc", "br"], ["sum"]),
             helper.make_node("Cast", ["sum"], ["sumf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["sumf", "s2"], ["y"])]
    g = helper.make_graph(
        nodes, "dynconv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 11])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 9, 11])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("same_scale", [True, False])
def test_conv_integer_bias_and_rescale_one_op(tmp_path, same_scale):
    """The eight ops around a dynamic ConvInteger become one ConvIntegerScaled computing the
    same steps: onnxruntime's output to the bit. Rescaled by another scale than the bias's,
    nothing fuses and the result is the same too."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "dynconv.onnx"
    onnx.save(_dynamic_conv_model(same_scale), path)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(path)
    kinds = list(e.choices.values())
    fused = any("1 ConvInteger layer(s) with their bias and rescale" in m for m in logs)
    assert fused == same_scale
    # (with the DynamicQuantizeLinear in front folded in too: tests/kernels/test_dq_qconv.py)
    assert kinds.count("TorchDynamicConvInteger") == int(same_scale)
    assert kinds.count("TorchConvInteger") == int(not same_scale)
    if same_scale:
        assert not any(k in kinds for k in ("TorchFloor", "TorchDiv", "TorchCast"))
    x = np.random.default_rng(7).standard_normal((1, 4, 9, 11)).astype(np.float32) * 3
    got = e.create_context().run({"x": x})["y"]
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert np.array_equal(got, want)
