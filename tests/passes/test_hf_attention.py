"""Attention as Hugging Face exports it (torch.onnx, TorchScript exporter, opset 17) -> one
kiln::Attention per layer: the SDPA path (scale split over Q and Kᵀ, additive mask from
Where(mask, 0, -inf), IsNaN -> Where safe softmax), the eager path, and the dynamo exporter's
SDPA decomposition (opset 18; Kᵀ as Reshape -> Transpose(0, 2, 1) -> Reshape)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.frontend import import_onnx
from kiln.ops import fused_transformer as FT
from kiln.passes.pipeline import optimize
from tests.passes.exports import bert_feeds, hf_bert, ort_run
from tests.passes.transformer_util import run

UP_TO_ATTENTION = {"fold_to_fixed_point", "fold_constants", "fold_shape_inputs",
                   "merge_transposes", "merge_reshapes", "remove_noops", "merge_common_nodes",
                   "remove_dead_nodes", "fuse_attention"}


FORMS = ["sdpa", "eager", "sdpa-dynamo"]


def _export(form: str) -> bytes:
    return hf_bert(form.split("-")[0], dynamo=form.endswith("-dynamo"))


def _optimized(data: bytes, only=None):
    g = import_onnx(data)
    before, logs = g.op_counts(), []
    optimize(g, log=logs.append, only=only)
    return g, before, logs


@pytest.mark.parametrize("form", FORMS)
def test_hf_attention_structure(form):
    g, before, _ = _optimized(_export(form), UP_TO_ATTENTION)
    assert before["Softmax"] == 2 and (form == "eager" or before["IsNaN"] == 2)
    ats = [n for n in g.nodes if n.op is FT.Attention]
    assert len(ats) == 2
    for at in ats:
        assert at.attrs.num_heads == 2 and at.attrs.causal == 0
        assert abs(at.attrs.scale - 1 / np.sqrt(16)) < 1e-6  # 0.5 * 0.5 in the SDPA form
        q, k, v, mask = at.inputs  # the projections' outputs [B, S, 32], and the mask
        assert [x.producer.op.name for x in (q, k, v)] == ["Add"] * 3  # the bias adds
        assert q.type.shape[-1] == 32 and mask.type.rank == 4
        assert mask.producer.op.name in ("Where", "Mul")  # SDPA: -inf where; eager: (1-m)*min


@pytest.mark.parametrize("form", FORMS)
def test_hf_attention_counts(form):
    g, _, _ = _optimized(_export(form))
    after = g.op_counts()
    assert after["Attention"] == 2
    for op in ("Softmax", "IsNaN", "MatMul", "Transpose"):
        assert op not in after, after
    masks = {id(n.inputs[3]) for n in g.nodes if n.op is FT.Attention}
    assert len(masks) == 1  # the layers' equal mask subgraphs were merged into one


@pytest.mark.parametrize("form", FORMS)
def test_hf_attention_numerics(form):
    data, f = _export(form), bert_feeds()
    want = ort_run(data, f)[0]
    g, _, _ = _optimized(data)
    got = run(g, f)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_no_fuse_attention_probs_are_an_output():
    # output_attentions=True: the probabilities are graph outputs, so the core must stay
    data = hf_bert("eager", probs_out=True)
    g, _, logs = _optimized(data)
    after = g.op_counts()
    assert "Attention" not in after and after["Softmax"] == 2
    assert sum("not fused: attention at node" in m for m in logs) == 2
    f = bert_feeds()
    for a, b in zip(run(g, f), ort_run(data, f)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_builder_reports_near_misses():
    from kiln.builder import Builder

    lines: list[str] = []
    b = Builder(log=lines.append)
    b.build(hf_bert("eager", probs_out=True))
    near = b.report["near_misses"]
    assert len(near) == 2 and all(m.startswith("attention at node '") for m in near)
    assert "also read outside the attention" in near[0]
    assert sum(m.startswith("not fused: attention") for m in lines) == 2  # the verbose log
