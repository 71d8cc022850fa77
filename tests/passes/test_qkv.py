import numpy as np

from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.qkv import fuse_qkv
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node

K, N_ = 8, 6
W = {f"w{p}": c(RNG.standard_normal((K, N_))) for p in "qkv"}
BIAS = {f"b{p}": c(RNG.standard_normal(N_)) for p in "qkv"}


def proj_nodes(bias=True, reader="Concat"):
    ns = []
    for p in "qkv":
        ns.append(node("MatMul", ["x", f"w{p}"], f"m{p}"))
        if bias:
            ns.append(node("Add", [f"b{p}", f"m{p}"], p))
    # one node reads q, k, v together (the attention, in a real model)
    read = ["q", "k", "v"] if bias else ["mq", "mk", "mv"]
    return ns + [node(reader, read, "y", axis=-1)]


def test_qkv_structure_counts_numerics():
    m = model(proj_nodes(), {"x": ["b", 5, K]}, ["y"], {**W, **BIAS})
    g, before, after, n, logs = apply(m, fuse_qkv, feeds(x=(2, 5, K)))
    assert n == 1 and before == {"Add": 3, "Concat": 1, "MatMul": 3}
    assert after == {"Add": 1, "Concat": 1, "MatMul": 1, "Split": 1}
    mm, add, split, cat = g.nodes
    assert mm.op is N.MatMul and mm.inputs[0] is g.inputs[0]
    np.testing.assert_array_equal(mm.inputs[1].const, np.concatenate(list(W.values()), 1))
    assert add.inputs[0] is mm.outputs[0] and split.op is T.Split
    assert split.inputs[0] is add.outputs[0] and cat.inputs == split.outputs
    assert tuple(split.attrs.split) == (N_, N_, N_)
    assert mm.name == "mq + mk + mv" and len(logs) == 1


def test_qkv_without_bias():
    m = model(proj_nodes(bias=False), {"x": [5, K]}, ["y"], W)
    g, _, after, n, _ = apply(m, fuse_qkv, feeds(x=(5, K)))
    assert n == 1 and after == {"Concat": 1, "MatMul": 1, "Split": 1}


def test_no_fuse_qkv_non_constant_weight():
    m = model(proj_nodes(), {"x": [5, K], "wk": [K, N_]}, ["y"],
              {**{k: v for k, v in W.items() if k != "wk"}, **BIAS})
    _, before, after, n, _ = apply(m, fuse_qkv, feeds(x=(5, K), wk=(K, N_)))
    assert n == 1 and after["MatMul"] == 2  # q and v merge; k keeps its runtime weight


def test_no_fuse_qkv_results_read_apart():
    ns = proj_nodes()[:-1]  # q, k, v are separate graph outputs: nothing reads them together
    m = model(ns, {"x": [5, K]}, ["q", "k", "v"], {**W, **BIAS})
    _, before, after, n, _ = apply(m, fuse_qkv, feeds(x=(5, K)))
    assert n == 0 and before == after
