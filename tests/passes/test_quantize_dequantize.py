"""Q/DQ pairs read by other ops run as one QuantizeDequantize: the kernel against the
QuantizeLinear + DequantizeLinear kernels bit for bit (ties, saturation, int8 and uint8), and the
fusion three ways plus the cases where it must not fire."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.builder import Builder, BuilderConfig
from kiln.frontend import import_onnx
from kiln.kernels.registry import Call
from kiln.kernels.torch import int8 as K
from kiln.kernels.torch import quant_linear as QL
from kiln.ops import int8 as I8
from kiln.ops import quant as Q
from kiln.passes.quantize.qdq import fuse_qdq_pairs


def _reference(x, s, z, signed):
    """QuantizeLinear then DequantizeLinear, kiln's ONNX kernels."""
    zp = torch.tensor(z, dtype=torch.int8 if signed else torch.uint8)
    sc = torch.tensor(s, dtype=torch.float32)
    q = QL.quantize_linear(Call(Q.QuantizeLinear.make_attrs(), 1, 3), x, sc, zp)
    return QL.dequantize_linear(Call(Q.DequantizeLinear.make_attrs(), 1, 3), q, sc, zp)


def _inputs(s):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3 * 5 * 37).astype(np.float32) * 200 * s  # many saturate
    ties = (np.arange(-300, 300) + 0.5).astype(np.float32) * np.float32(s)  # x / s near .5
    return torch.from_numpy(np.concatenate([x, ties, [0.0, -0.0, 1e30, -1e30]]).astype(
        np.float32))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("s,z,signed", [(0.0125, 0, True), (0.03, -7, True), (0.011, 128, False),
                                        (0.5, 3, False)])
def test_quantize_dequantize_matches_q_then_dq(monkeypatch, native, s, z, signed):
    from kiln import native as nat

    if native and not nat.available:
        pytest.skip("kiln's C kernels are not built")
    monkeypatch.setattr(nat, "available", native and nat.available)
    s = float(np.float32(s))
    x = _inputs(s)
    call = Call(I8.QuantizeDequantize.make_attrs(scale=s, zero=z, signed=int(signed)), 1, 1)
    for shape in [(-1,), (1, 3, 5, -1)]:
        if shape[-1] == -1 and len(shape) > 1:
            xs = x[:3 * 5 * 37].reshape(1, 3, 5, 37).transpose(2, 3)  # strided input
        else:
            xs = x
        got = K.quantize_dequantize(call, xs)
        want = _reference(xs, s, z, signed)
        assert got.dtype == torch.float32 and torch.equal(got, want)


def _model(readers: str, codes_out: bool = False) -> onnx.ModelProto:
    """x -> Q(int8) -> DQ -> (Add residual | two DQs | Relu reading the codes' DQ)."""
    s, z = np.array(0.02, np.float32), np.array(3, np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq")]
    if readers == "two":
        nodes += [helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd2"], name="dq2"),
                  helper.make_node("Mul", ["xd", "xd2"], ["y"], name="mul")]
    elif readers == "other_scale":
        nodes += [helper.make_node("DequantizeLinear", ["xq", "s2", "z"], ["xd2"], name="dq2"),
                  helper.make_node("Mul", ["xd", "xd2"], ["y"], name="mul")]
    else:
        nodes += [helper.make_node("Add", ["xd", "x"], ["y"], name="add")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])]
    if codes_out:
        outs.append(helper.make_tensor_value_info("xq", TensorProto.INT8, [4, 16]))
    inits = [numpy_helper.from_array(s, "s"), numpy_helper.from_array(z, "z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [4, 16])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("readers", ["residual", "two"])
def test_fuse_qdq_pairs_structure_counts_numerics(tmp_path, readers):
    ort = pytest.importorskip("onnxruntime")
    m = _model(readers)
    graph = import_onnx(m)
    assert fuse_qdq_pairs(graph) == (2 if readers == "two" else 1)
    counts = graph.op_counts()
    assert counts.get("QuantizeDequantize") == 1
    assert "QuantizeLinear" not in counts and "DequantizeLinear" not in counts
    fused = next(n for n in graph.nodes if n.op is I8.QuantizeDequantize)
    assert fused.name == "q + dq" and fused.inputs[0].name == "x"
    a = fused.attrs
    assert (a.scale, a.zero, a.signed) == (float(np.float32(0.02)), 3, 1)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    x = {"x": (np.random.default_rng(1).standard_normal((4, 16)) * 3).astype(np.float32)}
    e = Builder(BuilderConfig()).build(path)
    assert "TorchQuantizeLinear" not in e.choices.values()
    got = e.create_context().run(x)["y"]
    want = ort.InferenceSession(str(path)).run(None, x)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["codes_are_an_output", "other_scale"])
def test_no_fuse_qdq_pairs_codes_read_otherwise(case):
    m = _model("other_scale" if case == "other_scale" else "residual",
               codes_out=case == "codes_are_an_output")
    graph = import_onnx(m)
    assert fuse_qdq_pairs(graph) == 0
    assert graph.op_counts().get("QuantizeLinear") == 1
