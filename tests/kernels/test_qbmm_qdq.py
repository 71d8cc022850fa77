"""QLinearMatMulQDQ: QDQ's DQ -> MatMul -> Q of two activations (a QDQ model's attention
products) as kiln_qbmm_qdq (qgemm.c). The kernel on every path this CPU runs (forced) against
NumPy's int64 products with onnxruntime's float32 requantization steps (signed and unsigned
codes, saturation, odd shapes, broadcast batch dims, transposed and strided operands); the
fusion's structure and counts, its must-not-fire cases, and the built model against
onnxruntime, planned as a native record with no torch record left for it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln import native
from kiln.builder import Builder, BuilderConfig
from kiln.ir import DType, Graph, Node, TensorType, Value
from kiln.ops import int8 as I8
from kiln.ops import nn as N

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
PATHS = ["scalar", "avx2", "vnni"]


def _need(path):
    if path not in native.qgemm_paths():
        pytest.skip(f"this CPU has no {path} path")


def _codes(x, q):
    s, z, signed = q
    lo, hi = (-128, 127) if signed else (0, 255)
    return np.clip(np.round(x.astype(np.float32) / np.float32(s)) + z, lo, hi).astype(
        np.int64) - z


def _mult(aq, bq, yq):
    f = np.float32
    return float(f(f(aq[0]) * f(bq[0])) / f(yq[0]))


def _ref(a, b, aq, bq, yq):
    acc = np.matmul(_codes(a, aq), _codes(b, bq))
    s, z, signed = yq
    lo, hi = (-128, 127) if signed else (0, 255)
    q = np.clip(np.round(acc.astype(np.float32) * np.float32(_mult(aq, bq, yq))) + z, lo, hi)
    return (q - z).astype(np.float32) * np.float32(s)


SHAPES = [((12, 16, 64), (12, 64, 16)), ((2, 3, 37, 29), (2, 3, 29, 45)), ((5, 7), (7, 70)),
          ((1, 3, 9, 64), (3, 64, 33)), ((2, 1, 4, 5), (1, 3, 5, 6)), ((1, 2, 130, 3),
                                                                         (1, 2, 3, 9))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sa,sb", SHAPES)
@pytest.mark.parametrize("signed", [(1, 1, 1), (0, 0, 0), (1, 0, 0), (0, 1, 1)])
def test_qbmm_matches_int_reference(path, sa, sb, signed):
    _need(path)
    rng = np.random.default_rng(sum(sa) * 7 + sum(sb))
    a = rng.standard_normal(sa).astype(np.float32) * 2
    b = rng.standard_normal(sb).astype(np.float32) * 3
    a.reshape(-1)[:5] = 1e3  # saturating codes at both ends
    b.reshape(-1)[:5] = -1e3
    aq = (0.02, -3 if signed[0] else 131, signed[0])
    bq = (0.03, 5 if signed[1] else 120, signed[1])
    yq = (0.5, -2 if signed[2] else 128, signed[2])
    want = _ref(a, b, aq, bq, yq)
    got = native.qbmm_qdq(torch.from_numpy(a), torch.from_numpy(b), aq, bq, yq,
                          _mult(aq, bq, yq), path=path)
    np.testing.assert_array_equal(got.numpy(), want)
    # B as the transposed view of a [..., N, K] tensor (a key read as Kᵀ), A a strided slice
    bt = torch.from_numpy(np.ascontiguousarray(np.swapaxes(b, -1, -2))).transpose(-1, -2)
    wide = torch.zeros(*sa[:-1], sa[-1] + 3)
    wide[..., 1:sa[-1] + 1] = torch.from_numpy(a)
    got = native.qbmm_qdq(wide[..., 1:sa[-1] + 1], bt, aq, bq, yq, _mult(aq, bq, yq), path=path)
    np.testing.assert_array_equal(got.numpy(), want)


def test_paths_agree_and_bad_input_is_named():
    rng = np.random.default_rng(2)
    a = torch.from_numpy(rng.standard_normal((4, 33, 20)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal((4, 20, 41)).astype(np.float32))
    q = (0.01, 0, 1)
    outs = [native.qbmm_qdq(a, b, q, q, (0.05, 3, 0), 0.002, path=p).numpy()
            for p in native.qgemm_paths()]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    with pytest.raises(ValueError, match=r"cannot multiply \(4, 33, 20\) by \(4, 21, 41\)"):
        native.qbmm_qdq(a, torch.zeros(4, 21, 41), q, q, q, 1.0)
    with pytest.raises(ValueError, match="float32 CPU operands"):
        native.qbmm_qdq(a.double(), b, q, q, q, 1.0)


def _attention_model(out_q: bool = True, b_q: bool = True, shared_a: bool = False):
    """a [1, 2, 8, 16] @ Transpose(k [1, 2, 8, 16]) in QDQ form (int8 codes), the output
    quantized again and read by a Softmax. ``out_q=False``: the product goes to the Softmax
    unquantized; ``b_q=False``: Kᵀ is not quantized; ``shared_a``: a's dequantized values are
    an output too."""
    def qdq(x, s, z, nodes, inits):
        inits += [helper.make_tensor(f"{x}_s", TensorProto.FLOAT, [], [s]),
                  helper.make_tensor(f"{x}_z", TensorProto.INT8, [], [z])]
        nodes += [helper.make_node("QuantizeLinear", [x, f"{x}_s", f"{x}_z"], [f"{x}_q"]),
                  helper.make_node("DequantizeLinear", [f"{x}_q", f"{x}_s", f"{x}_z"],
                                   [f"{x}_d"])]
        return f"{x}_d"

    nodes, inits = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])], []
    ad = qdq("a", 0.021, -6, nodes, inits)
    kd = qdq("kt", 0.019, 5, nodes, inits) if b_q else "kt"
    nodes.append(helper.make_node("MatMul", [ad, kd], ["s"]))
    sd = qdq("s", 0.17, -4, nodes, inits) if out_q else "s"
    nodes.append(helper.make_node("Softmax", [sd], ["y"], axis=-1))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])]
    if shared_a:
        outs.append(helper.make_tensor_value_info(ad, TensorProto.FLOAT, [1, 2, 8, 16]))
    g = helper.make_graph(nodes, "qattn", [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 8, 16]) for n in "ak"],
        outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _feeds():
    rng = np.random.default_rng(5)
    return {n: (rng.standard_normal((1, 2, 8, 16)) * 1.5).astype(np.float32) for n in "ak"}


@pytest.mark.parametrize("path", PATHS)
def test_attention_product_fuses_and_matches_onnxruntime(path, tmp_path, monkeypatch):
    """One QLinearMatMulQDQ instead of the MatMul and its three pairs; the planned run is one
    qbmm record (no torch record for it) and gives onnxruntime's output."""
    ort = pytest.importorskip("onnxruntime")
    from kiln.engine.program_int8 import OP_QBMM

    _need(path)
    monkeypatch.setenv("KILN_QGEMM_PATH", path)
    p = tmp_path / "qattn.onnx"
    onnx.save(_attention_model(), p)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(p)
    kinds = list(e.choices.values())
    assert kinds.count("TorchQLinearMatMulQDQ") == 1
    assert "TorchMatMul" not in kinds and "TorchQuantizeDequantize" not in kinds
    assert any("1 MatMul(s) of two quantized activations" in m for m in logs)
    ctx = e.create_context()
    first = ctx.run(_feeds())["y"]
    got = ctx.run(_feeds())["y"]
    (plan,) = [pl for pl in e._executor.program.plans.values() if pl]
    assert plan.kinds.count(OP_QBMM) == 1
    assert I8.QLinearMatMulQDQ not in [fb.step.node.op for fb in plan.fallbacks]
    want = ort.InferenceSession(str(p)).run(None, _feeds())[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(first))
    assert np.abs(np.asarray(got) - want).max() <= 1e-6


def test_must_not_fire_without_the_pairs(tmp_path):
    """An unquantized product or operand: the MatMul stays a float MatMul. An operand pair
    read by something else too (a graph output) stays for that reader, and the fused op
    reads the float input."""
    for kw in ({"out_q": False}, {"b_q": False}):
        p = tmp_path / "m.onnx"
        onnx.save(_attention_model(**kw), p)
        kinds = list(Builder(BuilderConfig()).build(p).choices.values())
        assert "TorchQLinearMatMulQDQ" not in kinds, kw
        assert "TorchMatMul" in kinds or any("MatMul" in k for k in kinds), kw
    p = tmp_path / "shared.onnx"
    onnx.save(_attention_model(shared_a=True), p)
    kinds = list(Builder(BuilderConfig()).build(p).choices.values())
    assert kinds.count("TorchQLinearMatMulQDQ") == 1
    assert kinds.count("TorchQuantizeDequantize") == 1


def test_fusion_counts_on_a_graph():
    """Two products fuse; one whose output has a second reader does not."""
    from kiln.passes.quantize.qdq import fuse_qlinear_matmul

    g = Graph("g")
    t = TensorType(DType.float32, (2, 4, 4))

    def v(name):
        return Value(name, t)

    def qd(x, name, scale=0.1, zero=0, signed=1):
        y = v(name)
        g.nodes.append(Node(I8.QuantizeDequantize, name, [x], [y],
                            I8.QuantizeDequantize.make_attrs(scale=scale, zero=zero,
                                                             signed=signed)))
        return y

    x = v("x")
    g.inputs.append(x)
    outs = []
    for i, extra in enumerate((False, False, True)):
        a, b = qd(x, f"a{i}"), qd(x, f"b{i}", 0.2, 3, 0)
        m = v(f"m{i}")
        g.nodes.append(Node(N.MatMul, f"mm{i}", [a, b], [m]))
        outs.append(qd(m, f"y{i}", 0.3))
        if extra:
            outs.append(m)
    g.outputs += outs
    assert fuse_qlinear_matmul(g) == 2
    ops = [n.op for n in g.nodes]
    assert ops.count(I8.QLinearMatMulQDQ) == 2 and ops.count(N.MatMul) == 1
    fused = [n for n in g.nodes if n.op is I8.QLinearMatMulQDQ][0]
    assert fused.inputs == [x, x]
    a = fused.attrs
    assert (a.a_scale, a.b_scale, a.b_zero, a.b_signed, a.y_scale) == (0.1, 0.2, 3, 0, 0.3)


def test_torch_steps_match_the_kernel(monkeypatch):
    """The kernel's torch steps (where the C library does not run: CUDA, another dtype) give
    the C kernel's values."""
    from kiln.kernels.registry import Call
    from kiln.kernels.torch import int8 as K

    rng = np.random.default_rng(8)
    a = torch.from_numpy(rng.standard_normal((2, 3, 17, 24)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal((2, 3, 24, 19)).astype(np.float32))
    attrs = I8.QLinearMatMulQDQ.make_attrs(a_scale=0.013, a_zero=-6, a_signed=1, b_scale=0.02,
                                           b_zero=130, b_signed=0, y_scale=0.08, y_zero=-3,
                                           y_signed=1)
    want = K.qlinear_matmul_qdq(Call(attrs, 1, 1), a, b)
    monkeypatch.setattr(native, "available", False)
    got = K.qlinear_matmul_qdq(Call(attrs, 1, 1), a, b)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(got.numpy(), _ref(a.numpy(), b.numpy(), (0.013, -6, 1),
                                                    (0.02, 130, 0), (0.08, -3, 1)))


def test_fp16_build_keeps_the_quantized_ops_in_float32(tmp_path):
    """--fp16: the fused quantized ops run onnxruntime's float32 steps (Casts around them), as
    the QuantizeLinear/DequantizeLinear they replace do."""
    p = tmp_path / "qattn.onnx"
    onnx.save(_attention_model(), p)
    e = Builder(BuilderConfig(fp16=True)).build(p)
    (fused,) = [n for n in e.graph.nodes if n.op is I8.QLinearMatMulQDQ]
    assert [v.type.dtype for v in fused.inputs] == [DType.float32, DType.float32]
    assert fused.outputs[0].type.dtype is DType.float32
    from kiln.builder.precision import FP32_OPS

    assert {I8.DynamicConvInteger, I8.DynamicMatMulInteger} <= FP32_OPS


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sa,sb", [((1, 300, 64), (1, 64, 300)), ((4, 128, 64), (4, 64, 129))],
                         ids=["one-item-tiles-over-threads", "items-over-threads"])
def test_qbmm_threaded_branches(path, sa, sb):
    """Work large enough for kiln's team: one batch item's tiles split over the threads, and
    batch items split over them (each with its own scratch); the one-thread values."""
    _need(path)
    rng = np.random.default_rng(12)
    a = torch.from_numpy(rng.standard_normal(sa).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(sb).astype(np.float32))
    aq, bq, yq = (0.02, -3, 1), (0.03, 120, 0), (0.4, 5, 1)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(native.qbmm_qdq(a, b, aq, bq, yq, _mult(aq, bq, yq), path=path).numpy())
    finally:
        torch.set_num_threads(old)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], _ref(a.numpy(), b.numpy(), aq, bq, yq))
