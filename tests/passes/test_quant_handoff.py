"""Quantized hand-offs (kiln.passes.quantize.handoff): structure and counts on a small BERT's
CUDA INT8/FP8 graph, numerics against the same graph without them (torch kernels, and the
Triton kernels under TRITON_INTERPRET=1), and the cases that must not fire."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kiln.builder.calibration import apply_int8
from kiln.builder.config import BuilderConfig
from kiln.builder.precision import lower_precision
from kiln.engine.executor import Executor, default_choice
from kiln.frontend import import_onnx
from kiln.ir import DType, Graph, Node, TensorType, Value
from kiln.kernels.registry import kernels_for
from kiln.ops import int8 as I8
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.passes.pipeline import optimize
from kiln.passes.quantize.handoff import fuse_handoffs
from kiln.passes.verifier import verify

SMALL = dict(layers=2, hidden=64, heads=2, intermediate=128)
LAYERS = SMALL["layers"]


def _feeds(seed, batch=2, seq=8):
    from kiln.zoo import sample_inputs

    return sample_inputs("bert-base", batch, seq, seed=seed, **SMALL)


def _graph(fp8=False, handoff=True):
    from kiln.zoo import build_onnx

    g = optimize(import_onnx(str(build_onnx("bert-base", **SMALL))), device="cuda")
    cfg = BuilderConfig(device="cuda", fp16=True, int8=not fp8, fp8=fp8,
                        calib=[_feeds(s) for s in range(1, 3)])
    apply_int8(g, cfg, None)
    lower_precision(g, "fp16", io=True)
    counts = fuse_handoffs(g) if handoff else None
    verify(g, after="test")
    return g, counts


def _ops(g, op):
    return [n for n in g.nodes if n.op is op]


@pytest.mark.parametrize("fp8", [False, True])
def test_bert_handoff_structure(fp8):
    """Per layer: FC1 writes FC2's codes; the LayerNorms before Q/K/V and FC1 write their
    codes (the smoothing Mul folded into their multiplier); only the attention output
    projection still quantizes a float input; no separate quantize or smoothing op left."""
    g, counts = _graph(fp8)
    op = I8.Fp8MatMul if fp8 else I8.Int8MatMul
    codes = DType.float8e4m3fn if fp8 else DType.int8
    gemms = _ops(g, op)
    assert len(gemms) == 4 * LAYERS
    assert counts == {"gemm": LAYERS, "norm": 2 * LAYERS}
    assert len(_ops(g, I8.LayerNormQuant)) == 2 * LAYERS
    assert len(_ops(g, N.LayerNormalization)) == 1  # the last one: a graph output
    assert not _ops(g, M.Mul) and not _ops(g, I8.QuantizeDequantize)
    code_in = [n for n in gemms if n.inputs[0].type.dtype == codes]
    assert len(code_in) == 3 * LAYERS  # Q/K/V, FC1, FC2
    assert all(n.outputs[0].type.dtype == DType.float16 or n.attrs.out_scale > 0
               for n in gemms)
    writers = [n for n in gemms if n.attrs.out_scale > 0]
    assert len(writers) == LAYERS and all(n.attrs.activation == "Gelu" for n in writers)
    for w in writers:  # the reader's scale, the reader computes in FP16
        (r,) = [n for n in gemms if n.inputs[0] is w.outputs[0]]
        assert w.attrs.out_scale == r.attrs.x_scale
        assert fp8 or w.attrs.out_zero == r.attrs.x_zero
        assert r.attrs.out_float == DType.float16.onnx


def test_handoff_off_leaves_the_graph():
    g, _ = _graph(handoff=False)
    assert not _ops(g, I8.LayerNormQuant)
    assert all(n.attrs.out_scale == 0 and n.inputs[0].type.dtype == DType.float16
               for n in _ops(g, I8.Int8MatMul))


def _run(g, feeds, triton=False):
    import kiln.kernels.triton  # noqa: F401  (registers the CUDA kernels)

    def choose(node, backend):
        if triton and node.op in (I8.Int8MatMul, I8.Fp8MatMul, I8.LayerNormQuant):
            return kernels_for(node.op, "cuda")[0]
        return default_choice(node, "cpu")

    ex = Executor(g, "cpu", choose)
    outs = ex.run([torch.from_numpy(feeds[v.name]) for v in g.inputs])
    return [o.float().numpy() for o in outs]


def _cos(a, b):
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("fp8", [False, True])
def test_bert_handoff_numerics(fp8):
    """The hand-off graph computes what the graph without hand-offs does (the same codes,
    rounded once), on held-out inputs; and, under the interpreter, so do the Triton kernels."""
    held = _feeds(7)
    want = _run(_graph(fp8, handoff=False)[0], held)[0]
    g, _ = _graph(fp8)
    got = _run(g, held)[0]
    assert _cos(got, want) > 0.999
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    if os.environ.get("TRITON_INTERPRET") == "1":
        tri = _run(g, held, triton=True)[0]
        assert _cos(tri, got) > 0.999
        assert np.abs(tri - got).max() <= 0.05 * np.abs(got).max()


# ---------------------------------------------------------------- must not fire

def _value(name, dtype=DType.float16, shape=(4, 8)):
    return Value(name, TensorType(dtype, shape))


def _gemm(g, name, x, y, scale=0.1, zero=128, fp8=False, **attrs):
    k = x.type.shape[-1]
    wdt = DType.float8e4m3fn if fp8 else DType.int8
    w = g.add_weight(f"{name}_w", np.ones((k, 8), wdt.np), TensorType(wdt, (k, 8)))
    s = g.add_weight(f"{name}_s", np.ones(8, np.float32), TensorType(DType.float32, (8,)))
    if fp8:
        a = I8.Fp8MatMul.make_attrs(x_scale=scale, **attrs)
        return Node(I8.Fp8MatMul, name, [x, w, s], [y], a)
    a = I8.Int8MatMul.make_attrs(x_scale=scale, x_zero=zero, **attrs)
    return Node(I8.Int8MatMul, name, [x, w, s], [y], a)


def _small(readers):
    """x -> GEMM p -> v -> readers(v) (each a (kind, scale) or 'relu'), outputs all results."""
    g = Graph()
    x = _value("x")
    g.inputs = [x]
    v = _value("v")
    g.nodes = [_gemm(g, "p", x, v)]
    outs = []
    for i, r in enumerate(readers):
        y = _value(f"y{i}")
        if r == "relu":
            g.nodes.append(Node(M.Relu, f"r{i}", [v], [y], M.Relu.make_attrs()))
        else:
            g.nodes.append(_gemm(g, f"r{i}", v, y, scale=r[1], fp8=r[0] == "fp8"))
        outs.append(y)
    g.outputs = outs
    return g


@pytest.mark.parametrize("readers,fires", [
    ([("int8", 0.1)], True),
    ([("int8", 0.1), ("int8", 0.1)], True),
    ([("int8", 0.1), "relu"], False),  # a float reader
    ([("int8", 0.1), ("int8", 0.2)], False),  # two scales
    ([("fp8", 0.1)], False),  # an FP8 reader of an INT8 producer
])
def test_gemm_handoff_fires_only_for_8bit_readers_of_one_scale(readers, fires):
    g = _small(readers)
    counts = fuse_handoffs(g)
    p = g.nodes[0]
    assert counts["gemm"] == int(fires)
    assert (p.attrs.out_scale > 0) == fires
    assert (p.outputs[0].type.dtype == DType.int8) == fires
    verify(g, after="test")


def test_gemm_output_that_is_a_graph_output_stays_float():
    g = _small([("int8", 0.1)])
    g.outputs.append(g.nodes[0].outputs[0])
    assert fuse_handoffs(g)["gemm"] == 0


def test_layernorm_read_as_a_residual_only_stays():
    """A LayerNorm whose output an 8-bit GEMM reads only as its residual (no 8-bit X reader):
    no LayerNormQuant."""
    g = Graph()
    x, r_in = _value("x"), _value("x2")
    g.inputs = [x, r_in]
    v, y = _value("v"), _value("y")
    sc = g.add_weight("g", np.ones(8, np.float32), TensorType(DType.float32, (8,)))
    g.nodes = [Node(N.LayerNormalization, "ln", [x, sc, sc], [v],
                    N.LayerNormalization.make_attrs(axis=-1, epsilon=1e-5)),
               _gemm(g, "p", r_in, y, has_residual=1)]
    b = g.add_weight("b", np.zeros(8, np.float32), TensorType(DType.float16, (8,)))
    g.nodes[1].inputs += [b, v]
    g.outputs = [y]
    assert fuse_handoffs(g) == {"gemm": 0, "norm": 0}
    assert g.nodes[0].op is N.LayerNormalization


def _resnet(handoff=True):
    from kiln.zoo import build_onnx

    g = optimize(import_onnx(str(build_onnx("resnet50"))), device="cuda")
    rng = np.random.default_rng(0)
    cal = [{g.inputs[0].name: rng.standard_normal((1, 3, 64, 64)).astype(np.float32)}]
    apply_int8(g, BuilderConfig(device="cuda", fp16=True, int8=True, calib=cal), None)
    lower_precision(g, "fp16", io=True)
    counts = fuse_handoffs(g) if handoff else None
    verify(g, after="test")
    return g, counts


def test_resnet50_conv_handoffs():
    """Each bottleneck's 1x1 and 3x3 convs write the next conv's codes, and so does the last
    conv of a stage (its output only the next stage's first 1x1 and downsample read); the
    stem (read by MaxPool), the residual-carrying block outputs and the classifier's input
    stay float. The numbers match the graph without hand-offs."""
    g, counts = _resnet()
    convs = _ops(g, I8.Int8Conv)
    assert len(convs) == 53 and counts == {"gemm": 35, "norm": 0}
    assert len([c for c in convs if c.attrs.out_scale > 0]) == 35
    assert len([c for c in convs if c.inputs[0].type.dtype == DType.int8]) == 32 + 3 * 2
    assert convs[0].inputs[0].type.dtype == DType.float16  # the stem reads the image
    (fc,) = _ops(g, I8.Int8MatMul)
    assert fc.inputs[0].type.dtype == DType.float16 and fc.attrs.out_scale == 0
    feeds = {g.inputs[0].name: np.random.default_rng(9).standard_normal(
        (1, 3, 64, 64)).astype(np.float16)}
    got = _run(g, feeds)[0]
    want = _run(_resnet(handoff=False)[0], feeds)[0]
    assert _cos(got, want) > 0.999


def test_handoff_graph_round_trips_through_the_engine_file(tmp_path):
    """LayerNormQuant, the hand-off attributes and the int8 values between layers survive
    save/load: the loaded engine computes what the graph did."""
    from kiln.engine.engine import Engine, load

    g, _ = _graph()
    held = _feeds(8)
    want = _run(g, held)[0]
    e = Engine(g, {})
    e.save(tmp_path / "m.kiln")
    back = load(tmp_path / "m.kiln")
    ops = {n.op.name for n in back.graph.nodes}
    assert "LayerNormQuant" in ops
    assert sum(n.attrs.out_scale > 0 for n in back.graph.nodes if n.op is I8.Int8MatMul) == \
        LAYERS
    got = back.create_context().run(held)
    np.testing.assert_allclose(np.asarray(next(iter(got.values())), np.float32), want,
                               rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- on a GPU: whole builds

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_build(path, feeds, **cfg):
    import kiln

    prof = [kiln.Profile.fixed({k: v.shape for k, v in feeds.items()})]
    b = kiln.Builder(kiln.BuilderConfig(device="cuda", profiles=prof, **cfg))
    return b.build(str(path)), b.report


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_bert_int8_fp8_build(fp8):
    """A tuned CUDA INT8/FP8 build of a small BERT: the hand-off form in the engine graph,
    an 8-bit or FP16 tactic picked per layer, outputs close to the FP32 engine's on held-out
    inputs."""
    from kiln.zoo import build_onnx

    path = build_onnx("bert-base", **SMALL)
    feeds = _feeds(0, batch=4, seq=16)
    calib = [_feeds(s, batch=4, seq=16) for s in range(1, 4)]
    e, rep = _cuda_build(path, feeds, fp16=True, int8=not fp8, fp8=fp8, calib=calib)
    assert rep["int8"]["handoffs"] == {"gemm": LAYERS, "norm": 2 * LAYERS}
    assert sum(n.op is I8.LayerNormQuant for n in e.graph.nodes) == 2 * LAYERS
    op = "Fp8MatMul" if fp8 else "Int8MatMul"
    picks = {k: v["kernel"] for k, v in rep["autotune"].items()}
    q8 = [n.name for n in e.graph.nodes if n.op.name == op]
    assert q8 and all(picks.get(name) for name in q8)
    ref, _ = _cuda_build(path, feeds)
    held = _feeds(9, batch=4, seq=16)
    got = np.asarray(next(iter(e.create_context().run(held).values())), np.float32)
    want = np.asarray(next(iter(ref.create_context().run(held).values())), np.float32)
    assert _cos(got, want) > 0.99


@needs_cuda
def test_cuda_resnet50_int8_build():
    from kiln.zoo import build_onnx

    rng = np.random.default_rng(0)

    def img(b):
        return rng.standard_normal((b, 3, 64, 64)).astype(np.float32)

    path = build_onnx("resnet50")
    import onnx

    name = onnx.load(str(path), load_external_data=False).graph.input[0].name
    feeds = {name: img(8)}
    e, rep = _cuda_build(path, feeds, fp16=True, int8=True,
                         calib=[{name: img(8)} for _ in range(2)])
    assert rep["int8"]["handoffs"]["gemm"] == 35
    ref, _ = _cuda_build(path, feeds)
    held = {name: img(8)}
    got = np.asarray(next(iter(e.create_context().run(held).values())), np.float32)
    want = np.asarray(next(iter(ref.create_context().run(held).values())), np.float32)
    assert _cos(got, want) > 0.98


def test_cli_flag_turns_handoffs_off(monkeypatch, tmp_path):
    """``kiln build --no-int8-handoff`` reaches BuilderConfig.int8_handoff."""
    import kiln.builder
    from kiln.cli import main as cli

    seen = []

    def fake_build(self, model, base_dir=None):
        seen.append(self.config)
        raise SystemExit(0)

    monkeypatch.setattr(kiln.builder.Builder, "build", fake_build)
    for flags, want in (([], True), (["--no-int8-handoff"], False)):
        with pytest.raises(SystemExit):
            cli.main(["build", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.kiln"),
                      *flags])
        assert seen[-1].int8_handoff is want
