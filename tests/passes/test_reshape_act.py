"""sink_activation_through_reshape (CUDA builds): Gemm -> Reshape -> act ==> Gemm -> act ->
Reshape, so that conv_bias_act fuses the activation into the product (HF Conv1D: GPT-2)."""

from __future__ import annotations

import numpy as np

from kiln.frontend import import_onnx
from kiln.ops import fused_conv as FC
from kiln.passes.fusion.reshape_act import sink_activation_through_reshape as sink
from kiln.passes.pipeline import optimize
from tests.passes.exports import hf_gpt2, ort_run
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node, run

INITS = {"W": c(RNG.standard_normal((6, 8))), "b": c(RNG.standard_normal(8)),
         "flat": np.array([-1, 6]), "back": np.array([2, 3, 8]), "lo": c(-0.5), "hi": c(0.5)}


def _mlp(act="Relu", extra_out=None, act_inputs=None):
    """x [2, 3, 6] -> Reshape [6, 6] -> Gemm -> Reshape [2, 3, 8] -> act -> y."""
    ns = [node("Reshape", ["x", "flat"], "x2"), node("Gemm", ["x2", "W", "b"], "g"),
          node("Reshape", ["g", "back"], "g3"),
          node(act, act_inputs or ["g3"], "y")]
    outs = ["y"] + ([extra_out] if extra_out else [])
    return model(ns, {"x": [2, 3, 6]}, outs, INITS)


def test_sink_structure_counts_numerics():
    g, before, after, n, logs = apply(_mlp("Relu"), sink, feeds(x=(2, 3, 6)))
    assert n == 1 and before == after == {"Reshape": 2, "Gemm": 1, "Relu": 1}
    assert [x.op.name for x in g.nodes] == ["Reshape", "Gemm", "Relu", "Reshape"]
    _, gemm, relu, rs = g.nodes
    assert relu.inputs[0] is gemm.outputs[0]
    assert rs.inputs[0] is relu.outputs[0] and rs.outputs[0] is g.outputs[0]
    assert tuple(relu.outputs[0].type.shape) == (6, 8)
    assert logs[0].startswith("moved Relu 'y' before Reshape 'g3'")


def test_sink_clip_with_constant_bounds_then_fused():
    g, _, _, n, _ = apply(_mlp("Clip", act_inputs=["g3", "lo", "hi"]), sink, feeds(x=(2, 3, 6)))
    assert n == 1
    g2 = optimize(import_onnx(_mlp("Clip", act_inputs=["g3", "lo", "hi"])), device="cuda")
    fused = [x for x in g2.nodes if x.op is FC.FusedGemm]
    assert len(fused) == 1 and fused[0].attrs.activation == "Clip"


def test_no_sink_when_the_reshaped_product_is_read_elsewhere():
    _, _, after, n, _ = apply(_mlp("Relu", extra_out="g3"), sink, feeds(x=(2, 3, 6)))
    assert n == 0
    _, _, _, n, _ = apply(_mlp("Relu", extra_out="g"), sink, feeds(x=(2, 3, 6)))
    assert n == 0


def test_no_sink_when_not_a_product_or_a_computed_bound():
    ns = [node("Add", ["x", "x"], "s"), node("Reshape", ["s", "flat"], "s2"),
          node("Relu", ["s2"], "y")]
    _, _, _, n, _ = apply(model(ns, {"x": [2, 3, 6]}, ["y"], INITS), sink, feeds(x=(2, 3, 6)))
    assert n == 0
    ns = [node("Reshape", ["x", "flat"], "x2"), node("Gemm", ["x2", "W", "b"], "g"),
          node("Reshape", ["g", "back"], "g3"), node("Clip", ["g3", "lo_in", "hi"], "y")]
    m = model(ns, {"x": [2, 3, 6], "lo_in": []}, ["y"], INITS)
    f = feeds(x=(2, 3, 6))
    f["lo_in"] = np.array(-0.25, np.float32)
    _, _, _, n, _ = apply(m, sink, f)
    assert n == 0


def test_hf_gpt2_mlp_gelu_fuses_on_cuda_against_onnxruntime():
    """transformers' GPT2Model: each MLP's tanh GELU is its c_fc Gemm's epilogue in CUDA builds
    (FusedGemm, GeluTanh), fixed or dynamic dims; outputs match onnxruntime. CPU builds keep
    the Gelu nodes."""
    data = hf_gpt2()
    f = {"ids": RNG.integers(0, 50, (2, 8)), "mask": np.ones((2, 8), np.int64)}
    f["mask"][1, 6:] = 0
    want = ort_run(data, f)[0]
    for fixed in ({"ids": (2, 8), "mask": (2, 8)}, None):
        g = optimize(import_onnx(data, fixed=fixed), device="cuda")
        counts = g.op_counts()
        fused = [x for x in g.nodes if x.op is FC.FusedGemm]
        assert "Gelu" not in counts and len(fused) == 2
        assert all(x.attrs.activation == "GeluTanh" for x in fused)
        np.testing.assert_allclose(run(g, f)[0], want, rtol=1e-4, atol=1e-5)
    cpu = optimize(import_onnx(data), device="cpu")
    assert cpu.op_counts().get("Gelu") == 2
