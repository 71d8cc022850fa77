"""fuse_attention_keep_mask (CUDA builds): Attention(q, k, v, Where(keep, 0, -inf)) ->
Attention(q, k, v, keep), and keep = And(all-True const, x) -> x at x's (key-padding) shape.

Each unit test runs fuse_attention and then the pass on the written-out attention of
test_attention_fusion, whose mask is made as Hugging Face's SDPA export makes it; `apply` checks
the outputs before and after (the CPU executor's attention kernel is SDPA, which takes boolean
keep-masks as the CUDA kernels do)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.frontend import import_onnx
from kiln.ops import fused_transformer as FT
from kiln.passes.fusion.attention import fuse_attention
from kiln.passes.fusion.attention_mask import fuse_attention_keep_mask
from kiln.passes.pipeline import optimize
from tests.passes.exports import bert_feeds, hf_bert, ort_run
from tests.passes.test_attention_fusion import INITS, QKV, S, attention_nodes, qkv_feeds
from tests.passes.transformer_util import apply, c, model, node, run


def _masked(const_keep=None, fill=-np.inf, zero=0.0):
    """The attention, its mask = Where(And(const, Cast(pad) > 0), zero, fill)."""
    inits = dict(INITS, zero=c(zero), fill=c(fill),
                 qall=np.ones((1, 1, S, 1), bool) if const_keep is None else const_keep)
    ns = [node("Cast", ["pad"], "padb", to=9), node("And", ["qall", "padb"], "keep"),
          node("Where", ["keep", "zero", "fill"], "mask")] + attention_nodes()
    return model(ns, dict(QKV, pad=["b", 1, 1, S]), ["y"], inits)


def _feeds():
    f = qkv_feeds(pad=(2, 1, 1, S))
    f["pad"] = np.ones((2, 1, 1, S), np.float32)
    f["pad"][0, ..., S - 2:] = 0  # two padded keys in one sequence, one in the other
    f["pad"][1, ..., S - 1:] = 0
    return f


def _both(g, log):
    return fuse_attention(g, lambda m: None) + fuse_attention_keep_mask(g, log)


def test_keep_mask_structure_counts_numerics():
    g, before, after, n, logs = apply(_masked(), _both, _feeds())
    assert n == 2 and after == {"Attention": 1, "Cast": 1}
    assert before["Where"] == 1 and before["And"] == 1
    (cast, at) = g.nodes
    assert at.op is FT.Attention and at.inputs[3] is cast.outputs[0]
    assert at.inputs[3].type.shape[1:] == (1, 1, S) and at.inputs[3].type.dtype.name == "bool"
    assert len(logs) == 1 and "unbroadcast from 'keep'" in logs[0]


def test_keep_mask_kept_broadcast_when_the_and_constant_masks_something():
    q = np.ones((1, 1, 1, S), bool)
    q[0, 0, 0, 1] = False  # key 1 masked everywhere: the And is a real mask, not a broadcast
    g, _, after, n, logs = apply(_masked(q), _both, _feeds())
    assert n == 2 and after == {"Attention": 1, "Cast": 1, "And": 1}
    at = [x for x in g.nodes if x.op is FT.Attention][0]
    assert at.inputs[3].producer.op.name == "And" and "unbroadcast" not in logs[0]


@pytest.mark.parametrize("fill,zero", [(-0.5, 0.0), (0.0, -np.inf)],
                         ids=["small-negative", "reversed"])
def test_no_keep_mask_when_where_is_not_0_and_minus_inf(fill, zero):
    """Where(keep, 0, -0.5) shifts logits (not a mask); Where(keep, -inf, 0) masks where keep
    is True: neither is SDPA's keep-mask."""
    g, _, after, n, logs = apply(_masked(fill=fill, zero=zero), _both, _feeds())
    assert n == 1 and not logs and after["Where"] == 1


def test_no_keep_mask_on_a_causal_attention():
    g = import_onnx(_masked())
    fuse_attention(g, lambda m: None)
    (at,) = [x for x in g.nodes if x.op is FT.Attention]
    at.attrs = dataclasses.replace(at.attrs, causal=1)
    assert fuse_attention_keep_mask(g, lambda m: None) == 0
    assert at.inputs[3].producer.op.name == "Where"


def test_hf_bert_sdpa_export_cuda_pipeline_against_onnxruntime():
    """transformers' BertModel (SDPA) at a fixed [2, 8]: the CUDA pipeline's attentions read
    the bool key-padding mask [2, 1, 1, 8] (no float [2, 1, 8, 8] mask is made); outputs match
    onnxruntime with padding, and with one sequence's keys all masked. CPU builds keep the
    additive mask."""
    data = hf_bert("sdpa")
    fixed = {"ids": (2, 8), "mask": (2, 8)}
    g = optimize(import_onnx(data, fixed=fixed), device="cuda")
    ats = [x for x in g.nodes if x.op is FT.Attention]
    assert len(ats) == 2 and len({id(a.inputs[3]) for a in ats}) == 1
    m = ats[0].inputs[3]
    assert m.type.dtype.name == "bool" and tuple(m.type.shape) == (2, 1, 1, 8)
    assert "Where" not in g.op_counts() and "And" not in g.op_counts()
    f = bert_feeds()
    np.testing.assert_allclose(run(g, f)[0], ort_run(data, f)[0], rtol=1e-4, atol=1e-5)
    f["mask"][1, :] = 0  # every key of sequence 1 masked: the export's safe softmax gives 0s
    np.testing.assert_allclose(run(g, f)[0], ort_run(data, f)[0], rtol=1e-4, atol=1e-5)
    cpu = optimize(import_onnx(data, fixed=fixed), device="cpu")
    cm = [x for x in cpu.nodes if x.op is FT.Attention][0].inputs[3]
    assert cm.type.dtype.name != "bool"
