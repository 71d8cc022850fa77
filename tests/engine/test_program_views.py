"""Reshapes of strided values as views in native programs (kiln.engine.program.view_strides and
program_ops' Reshape planner): a transposed value split or merged along dims that stay
contiguous with each other is read in place, the impossible case is copied, and the dynamo
exporter's attention key (Reshape -> Transpose -> Reshape of a strided head) reaches the
attention record instead of a torch record."""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from bench.peers import max_rel_err
from kiln import native
from kiln.engine.program import (
    OP_TORCH,
    RECORD_KINDS,
    Meta,
    PlanContext,
    Val,
    contiguous_strides,
    view_strides,
)
from kiln.engine.program_ops import PLANNERS
from kiln.ops import tensor as T

RECORD_KINDS_BY_NAME = {v: k for k, v in RECORD_KINDS.items()}


def _np_view(a: np.ndarray, shape) -> np.ndarray | None:
    """numpy's reshape of ``a`` when it is a view (no copy), else None."""
    b = a.reshape(shape)
    return b if np.shares_memory(a, b) else None


def _cases():
    rng = np.random.default_rng(0)
    for shape in [(2, 3, 4), (1, 3, 5, 4), (2, 1, 6), (4, 6)]:
        base = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        for perm in itertools.permutations(range(len(shape))):
            a = base.transpose(perm)
            n = a.size
            news = {(n,), (1, n), (n, 1), a.shape[::-1], (a.shape[0], -1), (-1, a.shape[-1]),
                    (*a.shape[:-1], 1, a.shape[-1]), (1, *a.shape)}
            for _ in range(4):
                f = int(rng.choice([d for d in range(1, n + 1) if n % d == 0]))
                news.add((f, n // f))
            for new in news:
                yield a, tuple(a.reshape(new).shape)


def _elements(a: np.ndarray):
    return a.shape, tuple(s // a.itemsize for s in a.strides)


def test_view_strides_agree_with_numpy_and_read_the_same_elements():
    views = copies = 0
    for a, new in _cases():
        shape, strides = _elements(a)
        got = view_strides(shape, strides, new)
        want = _np_view(a, new)
        assert (got is None) == (want is None), (shape, strides, new, got)
        if got is None:
            copies += 1
            continue
        views += 1
        base = a.base if a.base is not None else a
        seen = np.lib.stride_tricks.as_strided(
            base.reshape(-1), new, [s * a.itemsize for s in got])
        np.testing.assert_array_equal(seen, a.reshape(new))
    assert views > 100 and copies > 20  # both kinds met


def test_view_strides_of_a_transposed_key():
    # [3, 197, 64] transposed to [3, 64, 197] (strides (64, 1, 576) of a [197, 3, 64] buffer)
    # seen as [1, 3, 64, 197]: a view whose head dim stays contiguous
    assert view_strides((3, 64, 197), (64, 1, 192 * 3), (1, 3, 64, 197)) == (
        3 * 64, 64, 1, 576)
    # merging the transposed dims is impossible: None (the planner copies)
    assert view_strides((3, 64, 197), (64, 1, 576), (3, 64 * 197)) is None
    # size-1 dims in, out, and an empty value
    assert view_strides((1, 4, 1), (7, 2, 9), (2, 2)) == (4, 2)
    assert view_strides((0, 3), (3, 1), (3, 0)) == contiguous_strides((3, 0))
    assert view_strides((2, 3), (3, 1), (7,)) is None  # another size


def _plan_reshape(x: Val, shape: tuple):
    """The Reshape planner run on ``x``: (its output value, the records it emitted)."""
    import torch

    pc = PlanContext({})
    made = PLANNERS[T.Reshape](pc, None, [x], [Meta(shape, contiguous_strides(shape),
                                                    torch.float32, ())])
    return made[0], pc.prog


def test_reshape_planner_views_what_it_can_and_copies_the_rest():
    x = Val((3, 64, 197), (64, 1, 576), 1, 5, 7)  # a transposed key, offset 5 into buffer 1
    y, prog = _plan_reshape(x, (1, 3, 64, 197))
    assert prog == [] and (y.buf, y.off, y.root) == (1, 5, 7) and y.strides == (192, 64, 1, 576)
    y, prog = _plan_reshape(x, (3, 64 * 197))
    assert prog  # one copy record
    assert y.strides == (64 * 197, 1) and y.root != 7 and y.off == 0
    y, prog = _plan_reshape(Val((4, 6), (6, 1), 1, 0, 7), (2, 2, 6))  # contiguous: a view
    assert prog == [] and y.strides == (12, 6, 1)


def _transposed_reshapes() -> onnx.ModelProto:
    """x [2, 3, 4, 5] transposed, reshaped as a view (split) and as a copy (merged), each fed to
    an elementwise op; the transposed value itself fed to a MatMul and a LayerNormalization
    (whose rows a strided view does not collapse to)."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    g = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "g")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    s1 = numpy_helper.from_array(np.array([2, 5, 1, 3, 4], np.int64), "s1")
    s2 = numpy_helper.from_array(np.array([10, 12], np.int64), "s2")
    mk = helper.make_node
    nodes = [mk("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]),  # [2, 5, 3, 4]
             mk("Reshape", ["xt", "s1"], ["v"]),  # [2, 5, 1, 3, 4]: a view
             mk("Relu", ["v"], ["a"], name="relu"),
             mk("Reshape", ["xt", "s2"], ["c"], name="merge"),  # merges 3 (stride 20) and 4
             mk("Sigmoid", ["c"], ["b_"]),
             mk("MatMul", ["xt", "w"], ["m"], name="mm"),  # strided rows: copied for the GEMM
             mk("LayerNormalization", ["xt", "g", "b"], ["n"], axis=-1, name="ln")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
            for n in ("a", "b_", "m", "n")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 3, 4, 5])], outs, [w, g, b, s1, s2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check(path, feeds_for, engine, runs=3):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ctx = engine.create_context()
    for seed in range(runs):  # the first run traces, the others run the plan
        feeds = feeds_for(seed)
        got = ctx.run(feeds)
        want = sess.run(None, feeds)
        assert max_rel_err([got[o.name] for o in sess.get_outputs()], want) <= 1e-5


def _plan_of(engine):
    program = engine._executor.program
    assert program is not None, engine._executor.program_blocked
    plans = [p for p in program.plans.values() if p]
    assert plans and not program.disabled
    return plans[-1]


def _records(plan) -> dict:
    """Node name -> the kinds of the records its step emitted, in order ("copy" for an
    elementwise Copy record, "torch" for a torch record); output copies left out."""
    prog, out = list(plan.prog), {}
    for pos, k in sorted(plan.rec_step.items()):
        if k >= len(plan.steps):
            continue
        kind = prog[pos]
        name = ("torch" if kind == OP_TORCH else "copy"
                if kind == RECORD_KINDS_BY_NAME["pointwise"] and prog[pos + 1] == native.POINTWISE[
                    "Copy"] else RECORD_KINDS[kind])
        out.setdefault(plan.steps[k].node.name, []).append(name)
    return out


@pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
def test_reshapes_of_transposed_values_match_onnxruntime(tmp_path, monkeypatch):
    from kiln.kernels.torch import fused_conv

    monkeypatch.setattr(fused_conv, "_FORCED", "kiln")  # planned where kiln's GEMM is traced
    path = tmp_path / "m.onnx"
    onnx.save(_transposed_reshapes(), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    _check(path, lambda seed: {"x": np.random.default_rng(seed).standard_normal(
        (2, 3, 4, 5)).astype(np.float32)}, engine)
    plan = _plan_of(engine)
    assert plan.fallbacks == []
    recs = _records(plan)
    # the split is a view: no record of its own, the Relu reads the transposed value in place
    assert recs["relu"] == ["pointwise"]
    views = {st.node.name for st in plan.steps if st.node.op is T.Reshape} - {"merge"}
    assert len(views) == 1 and not views & set(recs)
    # must not fire: the merge of two dims that do not step into each other is a copy
    assert recs["merge"] == ["copy"]
    # the GEMM and LayerNorm records take the transposed rows through a copy, not a torch record
    assert recs["mm"] == ["copy", "gemm"]
    assert recs["ln"] == ["copy", "layernorm"]


S, H, D = 10, 3, 8


def _dynamo_attention() -> onnx.ModelProto:
    """ViT attention as the dynamo exporter writes it: the qkv projection viewed as [1, S, 3,
    H, D], permuted to [3, 1, H, S, D], q, k, v sliced and squeezed out, the key transposed by
    Reshape [-1, S, D] -> Transpose -> Reshape [1, H, D, S], each side scaled by
    sqrt(scale), Softmax, the product with v, heads merged back, the output projection."""
    rng = np.random.default_rng(2)
    e = H * D

    def c(name, a):
        return numpy_helper.from_array(np.asarray(a), name)

    inits = [c("wqkv", rng.standard_normal((e, 3 * e)).astype(np.float32) * 0.3),
             c("bqkv", rng.standard_normal(3 * e).astype(np.float32) * 0.1),
             c("wo", rng.standard_normal((e, e)).astype(np.float32) * 0.3),
             c("s5", np.array([1, S, 3, H, D], np.int64)), c("z", np.array([0], np.int64)),
             c("o1", np.array([1], np.int64)), c("o2", np.array([2], np.int64)),
             c("o3", np.array([3], np.int64)), c("sk", np.array([-1, S, D], np.int64)),
             c("sk2", np.array([1, H, D, S], np.int64)),
             c("sc", np.array(D ** -0.25, np.float32)), c("so", np.array([1, S, e], np.int64))]
    mk = helper.make_node
    nodes = [mk("MatMul", ["x", "wqkv"], ["p"]), mk("Add", ["p", "bqkv"], ["lin"]),
             mk("Reshape", ["lin", "s5"], ["v5"], allowzero=1),
             mk("Transpose", ["v5"], ["perm"], perm=[2, 0, 3, 1, 4])]
    for name, lo, hi in (("q", "z", "o1"), ("k", "o1", "o2"), ("v", "o2", "o3")):
        nodes += [mk("Slice", ["perm", lo, hi, "z"], [name + "_sl"]),
                  mk("Squeeze", [name + "_sl", "z"], [name])]
    nodes += [mk("Reshape", ["k", "sk"], ["k3"]), mk("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
              mk("Reshape", ["kt3", "sk2"], ["kt"]),
              mk("Mul", ["q", "sc"], ["qs"]), mk("Mul", ["kt", "sc"], ["ks"]),
              mk("MatMul", ["qs", "ks"], ["sco"]), mk("Softmax", ["sco"], ["pr"], axis=-1),
              mk("MatMul", ["pr", "v"], ["att"]),
              mk("Transpose", ["att"], ["at"], perm=[0, 2, 1, 3]),
              mk("Reshape", ["at", "so"], ["merged"], allowzero=1),
              mk("MatMul", ["merged", "wo"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, S, e])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, S, e])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
def test_dynamo_attention_key_stays_in_the_program(tmp_path, monkeypatch):
    from kiln.kernels.torch import fused_conv

    monkeypatch.setattr(fused_conv, "_FORCED", "kiln")  # planned where kiln's GEMM is traced
    path = tmp_path / "m.onnx"
    onnx.save(_dynamo_attention(), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    steps = [st.node.op.name for st in engine._executor.steps]
    assert steps.count("Attention") == 1 and "Softmax" not in steps
    _check(path, lambda seed: {"x": np.random.default_rng(seed).standard_normal(
        (1, S, H * D)).astype(np.float32)}, engine)
    plan = _plan_of(engine)
    assert [fb.step.node.op.name for fb in plan.fallbacks] == []  # no torch record at all
    by_op = [(st.node.op.name, _records(plan).get(st.node.name, [])) for st in plan.steps]
    # the key's Reshape -> Transpose -> Reshape, the slices and squeezes: views, no record; the
    # attention reads q, k, v in place (their head dims stay contiguous: no copy)
    assert [r for op, r in by_op if op == "Attention"] == [["attention"]]
    assert [r for op, r in by_op if op in ("FusedMatMul", "MatMul")] == [["gemm"], ["gemm"]]
    views = [r for op, r in by_op if op in ("Reshape", "Transpose", "Slice", "Squeeze")]
    assert len(views) == 13
    # must not fire: merging the heads ([1, S, H, D] seen from [1, H, S, D]) is the one copy
    assert views[:-1] == [[]] * 12 and views[-1] == ["copy"]
    # every record the plan holds: those, and the output's copy out of the arena
    assert sorted(plan.kinds) == sorted([RECORD_KINDS_BY_NAME[k] for k in (
        "gemm", "gemm", "attention", "pointwise", "pointwise")])


def _attention_core(k_transposed: bool) -> onnx.ModelProto:
    """The attention core alone (num_heads 0): q [1, H, S, D] and v as given, the key a graph
    input [1, H, D, S] (its head dim strided: the record copies it) or [1, H, S, D] transposed
    by the graph (head dim contiguous: read in place)."""
    mk = helper.make_node
    sc = numpy_helper.from_array(np.array(D ** -0.5, np.float32), "sc")
    kshape = [1, H, S, D] if k_transposed else [1, H, D, S]
    nodes = ([mk("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="kt")] if k_transposed
             else [mk("Identity", ["k"], ["kt"], name="kt")])
    nodes += [mk("MatMul", ["q", "kt"], ["sco"]), mk("Mul", ["sco", "sc"], ["s2"]),
              mk("Softmax", ["s2"], ["pr"], axis=-1), mk("MatMul", ["pr", "v"], ["y"])]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
           for n, s in (("q", [1, H, S, D]), ("k", kshape), ("v", [1, H, S, D]))]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, [1, H, S, D])], [sc])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
@pytest.mark.parametrize("k_transposed", [False, True])
def test_attention_record_copies_a_strided_head_dim(tmp_path, k_transposed):
    path = tmp_path / "m.onnx"
    onnx.save(_attention_core(k_transposed), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
    steps = [st.node.op.name for st in engine._executor.steps]
    assert "Attention" in steps and "Softmax" not in steps
    kshape = (1, H, S, D) if k_transposed else (1, H, D, S)

    def feeds(seed):
        rng = np.random.default_rng(seed)
        return {"q": rng.standard_normal((1, H, S, D)).astype(np.float32),
                "k": rng.standard_normal(kshape).astype(np.float32),
                "v": rng.standard_normal((1, H, S, D)).astype(np.float32)}

    _check(path, feeds, engine)
    plan = _plan_of(engine)
    assert plan.fallbacks == []
    att = [r for st in plan.steps if st.node.op.name == "Attention"
           for r in [_records(plan).get(st.node.name)]]
    # a contiguous [1, H, D, S] key has its head dim strided: copied (must fire); a transposed
    # [1, H, S, D] one has it contiguous: read in place (must not)
    assert att == [["attention"]] if k_transposed else att == [["copy", "attention"]]


# ---- Expand: a broadcast view ---------------------------------------------------------------

def _expand_model(x_shape, shape, then):
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.array(shape, np.int64), "shape")]
    nodes = [mk("Expand", ["x", "shape"], ["e"])]
    if then == "reshape":  # grouped-query attention's repeat_kv: [B, Hkv, r, S, D] -> [B, H, S, D]
        b, hkv, r, s, d = shape
        inits.append(numpy_helper.from_array(np.array([b, hkv * r, s, d], np.int64), "s2"))
        nodes.append(mk("Reshape", ["e", "s2"], ["y"]))
    elif then == "add":
        nodes.append(mk("Add", ["e", "e"], ["y"]))
    elif then == "cumsum":  # a torch record reads the broadcast view (copied out for it)
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "ax"))
        nodes.append(mk("CumSum", ["e", "ax"], ["y"]))
    else:  # the expanded view is the output
        nodes.append(mk("Identity", ["e"], ["y"]))
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
@pytest.mark.parametrize("x_shape, shape, then", [
    ((1, 2, 1, 5, 4), (1, 2, 3, 5, 4), "reshape"),
    ((3, 1), (2, 3, 4), "add"),
    ((1, 4), (3, 4), "output"),
    ((2, 1, 3), (2, 5, 3), "add"),
    ((2, 1, 3), (2, 5, 3), "cumsum"),
])
def test_expand_is_a_view_and_matches_onnxruntime(x_shape, shape, then, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_expand_model(x_shape, shape, then), path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu", tf32=False)).build(str(path))
    ctx = engine.create_context()
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    ctx.run({"x": x})  # traced
    got = ctx.run({"x": x})["y"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    plan = next(p for p in engine._executor.program.plans.values() if p)
    # no torch record for the Expand: a view
    assert [fb.step.node.op.name for fb in plan.fallbacks] == (["CumSum"] if then == "cumsum"
                                                               else [])
