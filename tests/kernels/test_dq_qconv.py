"""DynamicConvInteger: onnxruntime's DynamicQuantizeLinear -> ConvInteger (+ bias, rescale)
folded into one op, on qconv.c's kiln_dq_qconv (AVX512-VNNI) or, with VNNI's kernels off
(``KILN_QGEMM_PATH=avx2``, what a CPU without VNNI runs), kiln's DynamicQuantizeLinear and the
exact float32 convolution chunks. Both against an int64 reference of onnxruntime's steps and
against onnxruntime; the fusion's structure, counts and must-not-fire cases; the native
program's record (VNNI) and its torch record (AVX2)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln import native
from kiln.builder import Builder, BuilderConfig
from kiln.ops import int8 as I8
from kiln.ops import quant as Q

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
ISAS = ["vnni", "avx2"]


@pytest.fixture
def isa(request, monkeypatch):
    if request.param not in native.qgemm_paths():
        pytest.skip(f"this CPU has no {request.param} path")
    monkeypatch.setenv("KILN_QGEMM_PATH", request.param)
    return request.param


def _model(c=6, oc=10, hw=(9, 13), wdtype=np.uint8, second_reader=False, const_ws=True,
           strides=(1, 1)):
    """x -> DynamicQuantizeLinear -> ConvInteger with the bias and rescale as the quantizer
    writes them. ``second_reader``: a bias-less ConvInteger reads the same codes (its output
    a second graph output); ``const_ws=False``: the weight scale is computed (Abs of one)."""
    rng = np.random.default_rng(11)
    if wdtype == np.uint8:
        w, wz = rng.integers(0, 256, (oc, c, 3, 3)).astype(np.uint8), np.uint8(121)
    else:
        w, wz = rng.integers(-128, 128, (oc, c, 3, 3)).astype(np.int8), np.int8(0)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(wz, "wz"),
             numpy_helper.from_array(np.array(0.0042, np.float32), "ws0"),
             numpy_helper.from_array((rng.standard_normal(oc) * 0.5).astype(np.float32), "B"),
             numpy_helper.from_array(np.array([1, -1, 1, 1], np.int64), "shape")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
    if const_ws:
        ws = "ws0"
    else:
        nodes.append(helper.make_node("Abs", ["ws0"], ["ws"]))
        ws = "ws"
    nodes += [helper.make_node("Mul", ["xs", ws], ["s1"]),
              helper.make_node("Mul", ["xs", ws], ["s2"]),
              helper.make_node("Div", ["B", "s1"], ["bd"]),
              helper.make_node("Floor", ["bd"], ["bf"]),
              helper.make_node("Cast", ["bf"], ["bi"], to=TensorProto.INT32),
              helper.make_node("Reshape", ["bi", "shape"], ["br"]),
              helper.make_node("ConvInteger", ["xq", "W", "xz", "wz"], ["acc"],
                               pads=[1, 1, 1, 1], strides=list(strides)),
              helper.make_node("Add", ["acc", "br"], ["sum"]),
              helper.make_node("Cast", ["sum"], ["sumf"], to=TensorProto.FLOAT),
              helper.make_node("Mul", ["sumf", "s2"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if second_reader:
        nodes.append(helper.make_node("ConvInteger", ["xq", "W", "xz", "wz"], ["acc2"]))
        outs.append(helper.make_tensor_value_info("acc2", TensorProto.INT32, None))
    g = helper.make_graph(nodes, "dynconv", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, *hw])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _x(c=6, hw=(9, 13), seed=3):
    return {"x": (np.random.default_rng(seed).standard_normal((1, c, *hw)) * 2.5 - 0.7)
            .astype(np.float32)}


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """onnxruntime's steps in NumPy: DynamicQuantizeLinear, the exact int64 convolution,
    int32(floor(B / S)) added, times S in float32."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w, wz, b = inits["W"].astype(np.int64), int(inits["wz"]), inits["B"]
    conv = [n for n in model.graph.node if n.op_type == "ConvInteger"][0]
    stride = [a.ints for a in conv.attribute if a.name == "strides"]
    sh, sw = stride[0] if stride else (1, 1)
    f = np.float32
    lo, hi = min(f(0), x.min()), max(f(0), x.max())
    xs = f(1) if hi == lo else f((hi - lo) / f(255))
    xz = np.round(np.clip(-lo / xs, 0, 255))
    q = np.clip(np.round(x / xs) + xz, 0, 255).astype(np.int64) - int(xz)
    q = np.pad(q, ((0, 0), (0, 0), (1, 1), (1, 1)))  # padding is the zero point: 0 here
    n, c, h, wd = q.shape
    oc = w.shape[0]
    oh, ow = (h - 3) // sh + 1, (wd - 3) // sw + 1
    acc = np.zeros((n, oc, oh, ow), np.int64)
    for i in range(3):
        for j in range(3):
            patch = q[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
            acc += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j] - wz)
    s = f(xs * inits["ws0"])
    acc += np.floor(b / s).astype(np.int64).reshape(1, -1, 1, 1)
    return acc.astype(np.float32) * s


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("wdtype", [np.uint8, np.int8])
@pytest.mark.parametrize("strides", [(1, 1), (2, 1)])
def test_fused_conv_matches_onnxruntime(isa, wdtype, strides, tmp_path):
    """One DynamicConvInteger for the nine ops; traced and planned runs give the reference's
    and onnxruntime's values to the bit; the planned run is one native record on VNNI, the
    torch record on AVX2."""
    ort = pytest.importorskip("onnxruntime")
    from kiln.engine.program_int8 import OP_DQCONV

    model = _model(wdtype=wdtype, strides=strides)
    p = tmp_path / "m.onnx"
    onnx.save(model, p)
    logs = []
    e = Builder(BuilderConfig(), log=logs.append).build(p)
    assert list(e.choices.values()) == ["TorchDynamicConvInteger"]
    assert any("1 ConvInteger layer(s) quantize their input themselves" in m for m in logs)
    ctx = e.create_context()
    first = np.asarray(ctx.run(_x())["y"])
    got = np.asarray(ctx.run(_x())["y"])
    (plan,) = [pl for pl in e._executor.program.plans.values() if pl]
    torch_ops = [fb.step.node.op for fb in plan.fallbacks]
    if isa == "vnni":
        assert plan.kinds.count(OP_DQCONV) == 1 and I8.DynamicConvInteger not in torch_ops
    else:
        assert OP_DQCONV not in plan.kinds and I8.DynamicConvInteger in torch_ops
    want = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, _x())[0]
    np.testing.assert_array_equal(got, first)
    np.testing.assert_array_equal(got, _reference(model, _x()["x"]))
    np.testing.assert_array_equal(got, want)


def test_kernel_paths_agree(monkeypatch):
    """kiln_dq_qconv against the two calls it replaces (kiln's DynamicQuantizeLinear, then
    qconv with S = x_scale * w_scale), and against the AVX2 torch steps."""
    if not native.qconv_available():
        pytest.skip("needs AVX512-VNNI")
    from kiln.kernels.registry import Call
    from kiln.kernels.torch import quant_linear as QL

    rng = np.random.default_rng(4)
    w = torch.from_numpy(rng.integers(-128, 128, (16, 8, 3, 3)).astype(np.int8))
    b = torch.from_numpy(rng.standard_normal(16).astype(np.float32))
    ws = torch.tensor(0.003, dtype=torch.float32)
    x = torch.from_numpy(rng.standard_normal((2, 8, 11, 17)).astype(np.float32))
    attrs = I8.DynamicConvInteger.make_attrs(pads=[1, 0, 1, 2], strides=[1, 2])
    fused = QL.dynamic_conv_integer(Call(attrs, 1, 5), x, w, None, b, ws)
    xq, xs, xz = native.dynamic_quantize(x)
    two = QL.conv_integer_scaled(Call(I8.ConvIntegerScaled.make_attrs(
        pads=[1, 0, 1, 2], strides=[1, 2]), 1, 6), xq, w, xz, None, b, xs * ws)
    np.testing.assert_array_equal(fused.numpy(), two.numpy())
    monkeypatch.setenv("KILN_QGEMM_PATH", "avx2")
    assert not native.qconv_available()
    slow = QL.dynamic_conv_integer(Call(attrs, 1, 5), x, w, None, b, ws)
    np.testing.assert_array_equal(fused.numpy(), slow.numpy())


def test_must_not_fire(tmp_path):
    """A computed weight scale: the ConvIntegerScaled stays with its DynamicQuantizeLinear.
    Codes a second convolution reads too: the first fuses, the quantizer stays for the
    second, and the outputs are onnxruntime's."""
    ort = pytest.importorskip("onnxruntime")
    p = tmp_path / "m.onnx"
    onnx.save(_model(const_ws=False), p)
    g = Builder(BuilderConfig()).build(p)
    kinds = list(g.choices.values())
    assert "TorchDynamicConvInteger" not in kinds and "TorchConvIntegerScaled" in kinds
    assert "TorchDynamicQuantizeLinear" in kinds
    p = tmp_path / "m2.onnx"
    onnx.save(_model(second_reader=True), p)
    e = Builder(BuilderConfig()).build(p)
    kinds = list(e.choices.values())
    assert kinds.count("TorchDynamicConvInteger") == 1 and kinds.count("TorchConvInteger") == 1
    assert kinds.count("TorchDynamicQuantizeLinear") == 1
    ctx = e.create_context()
    ctx.run(_x())
    got = ctx.run(_x())
    want = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, _x())
    np.testing.assert_array_equal(np.asarray(got["y"]), want[0])
    np.testing.assert_array_equal(np.asarray(got["acc2"]), want[1])


def test_fusion_counts_on_a_graph():
    """Two dynamic convolutions of one graph: both fuse, their quantizers and scale products
    are gone, the fused ops read the float inputs and the weight scales."""
    from kiln.ir import DType, Graph, Node, TensorType, Value
    from kiln.ops import math as M
    from kiln.passes.quantize.dynamic import fuse_dynamic_conv

    g = Graph("g")
    for i in range(2):
        x = Value(f"x{i}", TensorType(DType.float32, (1, 2, 5, 5)))
        g.inputs.append(x)
        xq, xs, xz = (Value(f"{n}{i}", TensorType(d, s)) for n, d, s in (
            ("xq", DType.uint8, (1, 2, 5, 5)), ("xs", DType.float32, ()), ("xz", DType.uint8, ())))
        w = g.add_weight(f"w{i}", np.ones((3, 2, 1, 1), np.int8),
                         TensorType(DType.int8, (3, 2, 1, 1)))
        b = g.add_weight(f"b{i}", np.ones(3, np.float32), TensorType(DType.float32, (3,)))
        ws = g.add_weight(f"ws{i}", np.array(0.5, np.float32), TensorType(DType.float32, ()))
        s = Value(f"s{i}", TensorType(DType.float32, ()))
        y = Value(f"y{i}", TensorType(DType.float32, (1, 3, 5, 5)))
        g.nodes += [Node(Q.DynamicQuantizeLinear, f"dql{i}", [x], [xq, xs, xz]),
                    Node(M.Mul, f"mul{i}", [xs, ws], [s]),
                    Node(I8.ConvIntegerScaled, f"conv{i}", [xq, w, xz, None, b, s], [y],
                         I8.ConvIntegerScaled.make_attrs())]
        g.outputs.append(y)
    assert fuse_dynamic_conv(g) == 2
    assert [n.op for n in g.nodes] == [I8.DynamicConvInteger] * 2
    assert [n.inputs[0].name for n in g.nodes] == ["x0", "x1"]
    assert [n.inputs[4].name for n in g.nodes] == ["ws0", "ws1"]
