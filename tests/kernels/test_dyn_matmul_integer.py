"""DynamicMatMulInteger: onnxruntime's DynamicQuantizeLinear -> MatMulInteger (uint8 weight codes
beyond the 7-bit grid, left unfolded) -> Cast -> Mul(x_scale * w_scale) -> Add(bias) as one op,
one qgemm record of the native program (the weight's codes - 128 packed, the column offset
128 - zero as a per-row add). Against onnxruntime to the bit on every qgemm path (forced),
with and without the bias, one and per-column scales; structure and counts; must-not-fire
(per-column weight zero points, a Cast read twice)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln import native
from kiln.builder import Builder, BuilderConfig
from kiln.ops import int8 as I8

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
PATHS = ["scalar", "avx2", "vnni"]


def _model(k=40, n=70, bias=True, per_col=False, per_col_zero=False, cast_twice=False):
    rng = np.random.default_rng(3)
    w = rng.integers(0, 256, (k, n)).astype(np.uint8)  # minus 119: -119..136, beyond int8
    wz = np.full(n, 119, np.uint8) if per_col_zero else np.uint8(119)
    if per_col_zero:
        wz[3] = 120
    ws = rng.uniform(0.001, 0.01, n if per_col else ()).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.asarray(wz), "wz"),
             numpy_helper.from_array(np.asarray(ws), "ws"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "B")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "W", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"]),
             helper.make_node("Mul", ["accf", "s"], ["m"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if bias:
        nodes.append(helper.make_node("Add", ["m", "B"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["m"], ["y"]))
    if cast_twice:
        nodes.append(helper.make_node("Relu", ["accf"], ["r"]))
        outs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "dynmm", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, k])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _x(k=40):
    return {"x": (np.random.default_rng(9).standard_normal((2, 8, k)) * 2 - 0.3).astype(
        np.float32)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"per_col": True}],
                         ids=["bias", "no-bias", "per-column-scale"])
def test_fused_matmul_integer_matches_onnxruntime(path, kw, tmp_path, monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    from kiln.engine.program_int8 import OP_QGEMM

    if path not in native.qgemm_paths():
        pytest.skip(f"this CPU has no {path} path")
    monkeypatch.setenv("KILN_QGEMM_PATH", path)
    p = tmp_path / "m.onnx"
    onnx.save(_model(**kw), p)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(p)
    kinds = list(e.choices.values())
    assert kinds.count("TorchDynamicMatMulInteger") == 1
    assert not any(k in kinds for k in ("TorchMatMulInteger", "TorchCast",
                                        "TorchDynamicQuantizeLinear"))
    assert any("1 MatMulInteger layer(s) with their quantizer" in m for m in logs)
    ctx = e.create_context()
    first = np.asarray(ctx.run(_x())["y"]).copy()
    got = np.asarray(ctx.run(_x())["y"])
    (plan,) = [pl for pl in e._executor.program.plans.values() if pl]
    assert plan.kinds.count(OP_QGEMM) == 1
    assert I8.DynamicMatMulInteger not in [fb.step.node.op for fb in plan.fallbacks]
    want = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, _x())[0]
    np.testing.assert_array_equal(got, first)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw", [{"per_col_zero": True}, {"cast_twice": True}],
                         ids=["per-column-zero", "cast-read-twice"])
def test_must_not_fire(kw, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    p = tmp_path / "m.onnx"
    onnx.save(_model(**kw), p)
    e = Builder(BuilderConfig()).build(p)
    kinds = list(e.choices.values())
    assert "TorchDynamicMatMulInteger" not in kinds and "TorchMatMulInteger" in kinds
    ctx = e.create_context()
    ctx.run(_x())
    got = ctx.run(_x())
    want = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, _x())
    np.testing.assert_array_equal(np.asarray(got["y"]), want[0])


def test_torch_steps_match(monkeypatch):
    """Without the C library's qgemm (another device, say) the kernel's torch steps give the
    qgemm call's values."""
    import torch

    from kiln.kernels.registry import Call
    from kiln.kernels.torch import quant_linear as QL

    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((5, 33)).astype(np.float32))
    w = torch.from_numpy(rng.integers(0, 256, (33, 20)).astype(np.uint8))
    wz = torch.tensor(119, dtype=torch.uint8)
    ws = torch.tensor(0.004, dtype=torch.float32)
    b = torch.from_numpy(rng.standard_normal(20).astype(np.float32))
    call = Call(I8.DynamicMatMulInteger.make_attrs(), 1, 5)
    fast = QL.dynamic_matmul_integer(call, x, w, wz, ws, b)
    monkeypatch.setattr(QL, "_dyn_qgemm", lambda *a: None)
    slow = QL.dynamic_matmul_integer(Call(I8.DynamicMatMulInteger.make_attrs(), 1, 5), x, w,
                                     wz, ws, b)
    np.testing.assert_array_equal(fast.numpy(), slow.numpy())
