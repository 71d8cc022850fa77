"""Transformer layers as native program records (kiln.engine.program_gemm): GEMMs with a
constant weight, LayerNorm and fused Attention run inside the program (no torch record for
them), the outputs match onnxruntime (kiln's zoo BERT with a padding mask and GPT-2, and a
corpus export with a KV cache), and the layouts the records cannot take stay torch records."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from bench.peers import max_rel_err
from kiln import native
from kiln.zoo import build_onnx, sample_inputs

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")

BERT = {"layers": 2, "hidden": 64, "heads": 2, "intermediate": 128, "vocab": 1000}
GPT2 = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 1000}
RECORD_OPS = {"MatMul", "FusedMatMul", "FusedMatMulLayerNorm", "LayerNormalization",
              "RMSNormalization", "Attention", "Gemm", "FusedGemm"}
CORPUS = Path(os.environ.get("KILN_CORPUS", Path.home() / ".cache/kiln/corpus"))


def _plan(engine):
    program = engine._executor.program
    assert program is not None, engine._executor.program_blocked
    plans = [p for p in program.plans.values() if p]  # (the build's tuning run made one too)
    assert plans and not program.disabled
    return plans[-1]  # the last signature run


def _torch_ops(plan) -> list[str]:
    return [fb.step.node.op.name for fb in plan.fallbacks]


@pytest.mark.parametrize("model,cfg,batch,seq", [("bert-base", BERT, 2, 16),
                                                 ("gpt2", GPT2, 1, 12)])
def test_transformer_layers_are_program_records(model, cfg, batch, seq, monkeypatch):
    from kiln.kernels.torch import fused_conv

    monkeypatch.setattr(fused_conv, "_FORCED", "kiln")  # planned where kiln's GEMM is traced
    path = str(build_onnx(model, **cfg))
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(path)
    layers = {st.node.op.name for st in engine._executor.steps}
    assert {"Attention", "FusedMatMul"} <= layers
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    ctx = engine.create_context()
    for seed in range(3):  # the first run traces, the others run the plan
        feeds = sample_inputs(model, batch, seq, seed=seed, **cfg)
        if "attention_mask" in feeds:  # padding: the mask reaches the attention record
            feeds["attention_mask"][-1, seq // 2 + seed:] = 0
        got = list(ctx.run(feeds).values())
        assert max_rel_err(got, sess.run(None, feeds)) <= 1e-5
    assert not RECORD_OPS & set(_torch_ops(_plan(engine)))


@pytest.mark.parametrize("name,op,count", [
    ("hf_llama_past_op17", "RMSNormalization", 9),  # 2 per layer and the final norm
    ("hf_gpt2_past_op17", "Gemm", 16),  # Conv1D: 4 per layer, x flattened to 2-D
])
def test_kv_cache_decode_step_runs_its_layers_in_the_program(name, op, count, monkeypatch):
    """Real exports of transformers' decode steps (past keys and values in and out): Llama
    (GQA, RoPE, RMSNorm written with Div(1, σ)) and GPT-2 (Conv1D as Gemm, its mask of unknown
    dims). kiln's GEMM is forced: a layer the tuner gives F.linear stays a torch record."""
    from kiln.kernels.torch import fused_conv

    monkeypatch.setattr(fused_conv, "_FORCED", "kiln")
    entry = CORPUS / f"{name}.onnx"
    if not entry.exists():
        pytest.skip(f"corpus model {entry} not built")
    from bench.corpus import manifest

    spec = manifest.load(CORPUS)[name]
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu", tf32=False)).build(str(entry))
    sess = ort.InferenceSession(str(entry), providers=["CPUExecutionProvider"])
    ctx = engine.create_context()
    for seed in range(3):
        feeds = spec.feeds(seed=seed)
        want = sess.run(None, feeds)
        got = ctx.run({i.name: feeds[i.name] for i in engine.inputs})
        assert max_rel_err([got[o.name] for o in sess.get_outputs()], want) <= 1e-4
    assert not RECORD_OPS & set(_torch_ops(_plan(engine)))
    steps = [st.node.op.name for st in engine._executor.steps]
    assert steps.count("Attention") == 4  # one per layer (GPT-2's mask: Expand to a computed
    assert "Softmax" not in steps  # shape, dims inference does not know)
    assert sum(s in (op, "Fused" + op) for s in steps) == count


def _untakeable() -> onnx.ModelProto:
    """y = LayerNorm_axis1(x) + (x @ x^T) @ w: a MatMul of two computed values and a LayerNorm
    over a middle axis, which the records do not take; z = x @ w2 is one they do."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(a).astype(np.float32), n)
             for n, a in (("w", (4, 6)), ("g", (4,)), ("b", (4,)), ("w2", (6, 5)))]
    mk = helper.make_node
    nodes = [mk("Transpose", ["x"], ["xt"], perm=[0, 2, 1]), mk("MatMul", ["x", "xt"], ["xx"]),
             mk("MatMul", ["xx", "x"], ["xxx"]),
             mk("LayerNormalization", ["xt", "g", "b"], ["ln"], axis=1),
             mk("Transpose", ["ln"], ["lnt"], perm=[0, 2, 1]), mk("Add", ["xxx", "lnt"], ["y"]),
             mk("MatMul", ["x", "w2"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [2, 4, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4, 5])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_no_record_for_computed_weights_or_inner_axis_norms(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_untakeable(), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx, rng = engine.create_context(), np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal((2, 4, 6)).astype(np.float32)
        got = ctx.run({"x": x})
        for name, want in zip(("y", "z"), sess.run(None, {"x": x})):
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)
    torch_ops = _torch_ops(_plan(engine))
    assert torch_ops.count("MatMul") == 2  # the two of computed values; x @ w2 is a record
    assert "LayerNormalization" in torch_ops


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_a_program_record(approximate, tmp_path):
    """Gelu after a Reshape (GPT-2's MLP: Gemm, Reshape, Gelu, no epilogue to join)."""
    mk = helper.make_node
    nodes = [mk("Mul", ["x", "two"], ["x2"]), mk("Gelu", ["x2"], ["y"], approximate=approximate)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [2, 5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 16])],
                          [numpy_helper.from_array(np.array(2, np.float32), "two")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx, rng = engine.create_context(), np.random.default_rng(0)
    for _ in range(3):
        x = (2 * rng.standard_normal((2, 5, 16))).astype(np.float32)
        np.testing.assert_allclose(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-6)
    assert "Gelu" in {st.node.op.name for st in engine._executor.steps}
    assert not _torch_ops(_plan(engine))


@pytest.mark.parametrize("index", [np.array(-5, np.int64), np.array([0, 2], np.int64)])
def test_gather_of_one_constant_index_is_a_view(index, tmp_path):
    """y = Relu(x)[:, i] * 2: one scalar index (BERT's pooler's first token, here counted from
    the end) is a view of the program value; an index vector is program_data's gather record."""
    mk = helper.make_node
    nodes = [mk("Relu", ["x"], ["r"]), mk("Gather", ["r", "i"], ["g"], axis=1),
             mk("Mul", ["g", "two"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [2, 5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array(2, np.float32), "two"),
                           numpy_helper.from_array(index, "i")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx, rng = engine.create_context(), np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((2, 5, 16)).astype(np.float32)
        np.testing.assert_array_equal(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0])
    assert "Gather" in {st.node.op.name for st in engine._executor.steps}
    assert _torch_ops(_plan(engine)) == []


@pytest.mark.parametrize("expand_planned", [True, False])
def test_broadcast_view_of_a_record_in_another_layout_keeps_the_program(expand_planned, tmp_path,
                                                                       monkeypatch):
    """y = Expand(Unsqueeze(Relu(Transpose(x)))) * 2: torch's Relu keeps the transposed strides,
    the Relu record writes a contiguous result, so the Expand as a torch record (a broadcast
    view: the planner taken out) comes out in another layout than traced; the program copies it
    into the traced one instead of stopping (transformers' GQA key/value repeat, as the dynamo
    exporter writes it). With its planner the Expand is a view of the Relu record's result."""
    from kiln.engine import planners
    from kiln.ops import tensor as T

    if not expand_planned:
        monkeypatch.delitem(planners.PLANNERS, T.Expand)
    mk = helper.make_node
    nodes = [mk("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]), mk("Relu", ["t"], ["r"]),
             mk("Unsqueeze", ["r", "ax"], ["u"]), mk("Expand", ["u", "shape"], ["e"]),
             mk("Mul", ["e", "two"], ["y"])]
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.array([2], np.int64), "ax"),
             numpy_helper.from_array(np.array([1, 4, 3, 8, 16], np.int64), "shape")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [1, 8, 4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx, rng = engine.create_context(), np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((1, 8, 4, 16)).astype(np.float32)
        np.testing.assert_array_equal(ctx.run({"x": x})["y"], sess.run(None, {"x": x})[0])
    assert _torch_ops(_plan(engine)) == ([] if expand_planned else ["Expand"])  # not disabled
