"""fold_qkv_split (CPU builds): the Split of a merged Q/K/V projection folded into the attention
that reads its three parts, on a one-layer BERT from kiln.zoo (structure, counts, numerics
against onnxruntime), kept out of CUDA builds, and not fired when a part is read elsewhere."""

from __future__ import annotations

import onnxruntime as ort
import pytest

import kiln
from bench.peers import max_rel_err
from kiln.frontend import import_onnx
from kiln.ops import fused_transformer as FT
from kiln.ops import tensor as T
from kiln.passes.fusion.packed_qkv import fold_qkv_split
from kiln.passes.pipeline import optimize
from kiln.passes.verifier import verify
from kiln.zoo import build_onnx, sample_inputs

TINY = {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128, "vocab": 1000}


@pytest.fixture(scope="module")
def onnx_path():
    return str(build_onnx("bert-base", **TINY))


def test_cpu_build_folds_the_split_and_matches_onnxruntime(onnx_path):
    logs: list[str] = []
    builder = kiln.Builder(kiln.BuilderConfig(device="cpu"), log=logs.append)
    engine = builder.build(onnx_path)
    folded = [m for m in logs if m.startswith("folded ") and "(split)" in m]
    assert len(folded) == 1 and "Split" not in builder.report["nodes_after"]
    feeds = sample_inputs("bert-base", 2, 16, **TINY)
    got = engine.create_context().run(feeds)
    want = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert max_rel_err(list(got.values()), want) <= 1e-5


def _attention(graph):
    (att,) = [n for n in graph.nodes if n.op is FT.Attention]
    return att


def test_structure_on_cpu_and_left_alone_on_cuda(onnx_path):
    cpu = optimize(import_onnx(onnx_path), device="cpu")
    att = _attention(cpu)
    assert att.attrs.qkv_split == [64, 64, 64]
    assert att.inputs[1] is None and att.inputs[2] is None
    assert att.inputs[0].type.shape[-1] == 192  # the merged projection's output
    assert not [n for n in cpu.nodes if n.op is T.Split]
    cuda = optimize(import_onnx(onnx_path), device="cuda")
    assert not _attention(cuda).attrs.qkv_split
    assert len([n for n in cuda.nodes if n.op is T.Split]) == 1


def test_no_fold_when_a_part_is_read_elsewhere(onnx_path):
    g = optimize(import_onnx(onnx_path), device="cuda")  # the Split is still there
    att = _attention(g)
    g.outputs.append(att.inputs[1])  # k is also a graph output now
    assert fold_qkv_split(g, lambda m: None) == 0
    verify(g)
    assert not _attention(g).attrs.qkv_split and any(n.op is T.Split for n in g.nodes)
    g.outputs.pop()
    logs: list[str] = []
    assert fold_qkv_split(g, logs.append) == 1
    verify(g)
    assert logs and logs[0].startswith("folded ")
