"""kiln's qgemm (qgemm.c) as the CPU tactic of Int8MatMul and Int8MatMulQDQ: each qgemm path
(the scalar loop, AVX2, VNNI where the CPU has it; ``KILN_QGEMM_PATH``) against NumPy's exact
integers and against the FBGEMM tactic; the rule that keeps qgemm off full-range weights where
the CPU's u8s8 GEMMs saturate (must not fire); and the native program's qgemm record, end to
end against onnxruntime, with no torch record left for the INT8 layers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from kiln import native
from kiln.builder import Builder, BuilderConfig
from kiln.kernels.registry import Call
from kiln.kernels.torch import int8 as K
from kiln.ops import int8 as I8
from tests.ort_util import calibration_reader

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
PATHS = ["scalar", "avx2", "vnni"]


@pytest.fixture
def path(request, monkeypatch):
    if request.param not in native.qgemm_paths():
        pytest.skip(f"this CPU has no {request.param} path")
    monkeypatch.setenv("KILN_QGEMM_PATH", request.param)
    return request.param


def _force(monkeypatch, name):
    monkeypatch.setattr(K, "_FORCED", name)


def _call(op, **attrs):
    return Call(op.make_attrs(**attrs), 1, 5)


def _weights(rng, k, n, full=False):
    top = 128 if full else 64
    wq = rng.integers(-top + (0 if full else 1), top, (k, n)).astype(np.int8)
    return wq, rng.uniform(0.002, 0.02, n).astype(np.float32)


def _exact(codes, zero, scale, wq, ws):
    acc = codes.astype(np.int64) @ wq.astype(np.int64) - zero * wq.astype(np.int64).sum(0)
    return acc.astype(np.float32) * (np.float32(scale) * ws)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_dynamic_int8_matmul_on_qgemm(path, monkeypatch):
    """x_scale 0: DynamicQuantizeLinear's codes of the whole input, the exact products, bias,
    residual and GELU in the epilogue; close to the FBGEMM tactic."""
    _force(monkeypatch, "qgemm")
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((2, 9, 40)).astype(np.float32))
    wq, ws = _weights(rng, 40, 27)
    b = rng.standard_normal(27).astype(np.float32)
    r = torch.from_numpy(rng.standard_normal((2, 9, 27)).astype(np.float32))
    call = _call(I8.Int8MatMul, x_scale=0.0, activation="Gelu", has_residual=1)
    args = (x, torch.from_numpy(wq), torch.from_numpy(ws), torch.from_numpy(b), r)
    got = K.int8_matmul(call, *args)
    assert call.cache["lin_tactics"] == {(2, 9, 40): "qgemm"}
    assert call.cache["w_qgemm"].path == path
    codes, scale, zero = native.dynamic_quantize(x.reshape(-1, 40).contiguous())
    pre = _exact(codes.numpy(), int(zero), float(scale), wq, ws) + b + r.reshape(-1, 27).numpy()
    want = torch.nn.functional.gelu(torch.from_numpy(pre)).reshape(2, 9, 27)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if K._HAS_FBGEMM:
        other = _call(I8.Int8MatMul, x_scale=0.0, activation="Gelu", has_residual=1)
        _force(monkeypatch, "fbgemm")
        torch.testing.assert_close(K.int8_matmul(other, *args), got, rtol=1e-5, atol=1e-5)
        assert other.cache["lin_tactics"] == {(2, 9, 40): "fbgemm"}


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_static_int8_matmul_on_qgemm(path, monkeypatch):
    """Fixed x_scale / x_zero: QuantizeLinear's codes; a residual that broadcasts goes after
    the GEMM (torch), the activation with it."""
    _force(monkeypatch, "qgemm")
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((7, 33)).astype(np.float32))
    wq, ws = _weights(rng, 33, 12)
    r = torch.from_numpy(rng.standard_normal(12).astype(np.float32))  # broadcast [N]
    call = _call(I8.Int8MatMul, x_scale=0.02, x_zero=120, activation="Relu", has_residual=1)
    got = K.int8_matmul(call, x, torch.from_numpy(wq), torch.from_numpy(ws), None, r)
    codes = torch.clamp(torch.round(x / np.float32(0.02)) + 120, 0, 255).to(torch.uint8)
    want = np.maximum(_exact(codes.numpy(), 120, 0.02, wq, ws) + r.numpy(), 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("signed", [1, 0])
def test_int8_matmul_qdq_on_qgemm_equals_fbgemm(path, signed, monkeypatch):
    """QLinearMatMul's requantization in qgemm's epilogue: the same floats as FBGEMM's products
    requantized by kiln (both exact integers, the same float32 steps)."""
    if not K._HAS_FBGEMM:
        pytest.skip("no FBGEMM to compare with")
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((3, 5, 48)).astype(np.float32))
    wq, ws = _weights(rng, 48, 20)
    attrs = dict(x_scale=0.03, x_zero=7, y_scale=0.05, y_zero=-4 if signed else 130,
                 y_signed=signed)
    outs = {}
    for name in ("qgemm", "fbgemm"):
        _force(monkeypatch, name)
        call = _call(I8.Int8MatMulQDQ, **attrs)
        outs[name] = K.int8_matmul_qdq(call, x, torch.from_numpy(wq), torch.from_numpy(ws))
        assert call.cache["lin_tactics"] == {(3, 5, 48): name}
    assert torch.equal(outs["qgemm"], outs["fbgemm"])


def test_qgemm_left_out_where_u8s8_saturates(monkeypatch):
    """Where the CPU's u8s8 GEMMs add int16 pairs with saturation (AVX2 without VNNI), the
    exact qgemm would not compute onnxruntime's integers on full-range weights: it is no
    candidate there (even forced); on 7-bit weights it is; on a CPU with VNNI it always is."""
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32))
    full, ws = _weights(rng, 16, 8, full=True)
    small, _ = _weights(rng, 16, 8)
    _force(monkeypatch, "qgemm")
    for saturates, wq, ok in ((True, full, False), (True, small, True), (False, full, True)):
        monkeypatch.setattr(K, "u8s8_saturates", lambda s=saturates: s)
        call = _call(I8.Int8MatMul, x_scale=0.0)
        assert K._qgemm_ok(call, x, torch.from_numpy(wq)) is ok
        K.int8_matmul(call, x, torch.from_numpy(wq), torch.from_numpy(ws))
        assert (call.cache["lin_tactics"][(4, 16)] == "qgemm") is ok


def _mlp_models(tmp_path):
    """The same MLP from onnxruntime's quantize_dynamic and quantize_static (QDQ)."""
    pytest.importorskip("onnxruntime")
    from onnxruntime.quantization import (
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    src = tmp_path / "mlp.onnx"
    torch.onnx.export(mlp.eval(), (torch.randn(2, 8, 32),), str(src), input_names=["x"],
                      output_names=["y"], dynamo=False)
    dyn, qdq = tmp_path / "mlp.dyn.onnx", tmp_path / "mlp.qdq.onnx"
    quantize_dynamic(str(src), str(dyn), weight_type=QuantType.QInt8)

    rng = np.random.default_rng(5)
    reader = calibration_reader([{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)}
                                 for _ in range(4)])
    quantize_static(str(src), str(qdq), reader, quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return {"dynamic": dyn, "qdq": qdq}


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_program_runs_int8_layers_as_qgemm_records(path, tmp_path, monkeypatch):
    """Both models' INT8 layers on the qgemm tactic become qgemm records of the native program
    (no torch record for them), and the planned runs match onnxruntime's outputs."""
    import onnxruntime as ort

    from kiln.engine.program_int8 import OP_QGEMM

    _force(monkeypatch, "qgemm")
    x = {"x": np.random.default_rng(6).standard_normal((2, 8, 32)).astype(np.float32)}
    for kind, model in _mlp_models(tmp_path).items():
        onnx.checker.check_model(str(model))
        e = Builder(BuilderConfig()).build(model)
        ctx = e.create_context()
        first = ctx.run(x)["y"]  # traced
        got = ctx.run(x)["y"]  # planned
        plans = [p for p in e._executor.program.plans.values() if p]
        assert len(plans) == 1, kind
        torch_ops = [fb.step.node.op for fb in plans[0].fallbacks]
        assert I8.Int8MatMul not in torch_ops and I8.Int8MatMulQDQ not in torch_ops, kind
        assert plans[0].kinds.count(OP_QGEMM) == 2, kind
        want = ort.InferenceSession(str(model)).run(None, x)[0]
        assert np.array_equal(got, first), kind
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), kind


def test_program_keeps_fbgemm_layers_as_torch_records(tmp_path, monkeypatch):
    """Must not fire: a layer whose traced tactic is FBGEMM stays a torch record."""
    if not K._HAS_FBGEMM:
        pytest.skip("no FBGEMM")
    from kiln.engine.program_int8 import OP_QGEMM

    _force(monkeypatch, "fbgemm")
    x = {"x": np.random.default_rng(6).standard_normal((2, 8, 32)).astype(np.float32)}
    e = Builder(BuilderConfig()).build(_mlp_models(tmp_path)["dynamic"])
    ctx = e.create_context()
    ctx.run(x)
    ctx.run(x)
    (plan,) = [p for p in e._executor.program.plans.values() if p]
    assert OP_QGEMM not in plan.kinds
    assert [fb.step.node.op for fb in plan.fallbacks].count(I8.Int8MatMul) == 2


@pytest.mark.parametrize("signed", [0, 1])
def test_program_runs_quantize_dequantize_as_elementwise_record(signed, tmp_path):
    """A Q/DQ pair read by an Add (kept as QuantizeDequantize) is an elementwise record of the
    program, not a torch record, and gives onnxruntime's values to the bit."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from kiln.engine.program_ops import OP_PW

    zt = TensorProto.INT8 if signed else TensorProto.UINT8
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("Add", ["d", "x"], ["y"])]
    g = helper.make_graph(
        nodes, "qdq_add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 40])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.037]),
         helper.make_tensor("z", zt, [], [-5 if signed else 131])])
    path = tmp_path / "qdq_add.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    x = {"x": (np.random.default_rng(9).standard_normal((3, 40)) * 4).astype(np.float32)}
    e = Builder(BuilderConfig()).build(path)
    ctx = e.create_context()
    ctx.run(x)
    got = ctx.run(x)["y"]
    (plan,) = [p for p in e._executor.program.plans.values() if p]
    assert "TorchQuantizeDequantize" in e.choices.values()  # the op is there...
    assert I8.QuantizeDequantize not in [fb.step.node.op for fb in plan.fallbacks]  # ...planned
    assert plan.kinds.count(OP_PW) >= 1
    want = ort.InferenceSession(str(path)).run(None, x)[0]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_int8_tactic_picks_travel_in_the_engine_file(tmp_path, monkeypatch):
    """The build's timed INT8 picks (Int8MatMul of the dynamic model, Int8MatMulQDQ of the QDQ
    one, where FBGEMM and qgemm both run) are stored in the engine file; a fresh process's
    loaded engine (the process-wide picks emptied) takes them at its first run and times
    nothing, and its outputs are the built engine's."""
    if not K._HAS_FBGEMM:
        pytest.skip("no FBGEMM: one candidate, nothing timed")
    import kiln
    from kiln.kernels.torch import fused_conv as FCK

    monkeypatch.setattr(FCK, "_choices", {})
    x = {"x": np.random.default_rng(6).standard_normal((2, 8, 32)).astype(np.float32)}
    for kind, model in _mlp_models(tmp_path).items():
        FCK._choices.clear()
        e = Builder(BuilderConfig()).build(model)
        int8 = {s: v for s, v in e.cpu_tactics.items() if s[0] == "int8"}
        assert len(int8) == 2 and set(int8.values()) <= {"fbgemm", "qgemm"}, kind
        want = e.create_context().run(x)["y"]
        e.save(tmp_path / f"{kind}.kiln")
        FCK._choices.clear()
        timed = []
        real = K._pick

        def spy(n, key, can, run, sig=(), real=real, timed=timed):
            return real(n, key, can, lambda name: timed.append(name) or run(name), sig)
        monkeypatch.setattr(K, "_pick", spy)
        loaded = kiln.load(tmp_path / f"{kind}.kiln")
        assert {s: v for s, v in loaded.cpu_tactics.items() if s[0] == "int8"} == int8
        got = loaded.create_context().run(x)["y"]
        assert timed == [], kind
        np.testing.assert_array_equal(got, want)
        monkeypatch.setattr(K, "_pick", real)
    # must not fire: a file's unknown tactic name is not taken, and a GEMM's nearest-shape
    # lookup passes over the INT8 rows (of the same length as its own signature)
    sig = next(s for s in int8 if s[1] == "qdq")
    FCK._choices.clear()
    FCK.preload_picks({sig: "bogus"})
    assert sig not in FCK._choices
    FCK.preload_picks(int8)
    assert FCK._nearest(((2, 8, 32), (16, 32), True, "", 1.0, None, 2)) is None
