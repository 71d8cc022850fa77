"""Q, K and V projections of one input -> one wide GEMM whose result is split.

BERT-style exports project the same hidden state three times::

    x ─┬─MatMul(Wq)─Add(bq)──▶ q ─┐
       ├─MatMul(Wk)─Add(bk)──▶ k ─┼─▶ Attention
       └─MatMul(Wv)─Add(bv)──▶ v ─┘

which becomes ``Split(Add(MatMul(x, [Wq|Wk|Wv]), [bq|bk|bv]), axis=-1) -> q, k, v``: x is read
once, and one [K, 3N] product keeps the cores busier than three [K, N] ones. The split results
are views, which Attention reads in place. Only projections read together by one node (the
attention) are merged, each with a constant 2-D weight and (all or none) a constant bias.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.ir.rewrite import replace_uses
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.match import Users, add_const, const_of, other, shape_of


def projection(users: Users, mm: Node) -> tuple[np.ndarray, np.ndarray | None, Node | None,
                                                   Value] | None:
    """MatMul(x, W) [+ b] with constant W [K, N] and b [N] -> (W, b, add, result)."""
    w = const_of(mm.inputs[1])
    if w is None or w.ndim != 2 or const_of(mm.inputs[0]) is not None:
        return None
    out = mm.outputs[0]
    add = users.only(out)
    if add is not None and add.op is M.Add:
        b = const_of(other(add, out))
        if b is not None and b.size == w.shape[1] and b.ndim >= 1 and \
                b.shape[-1] == w.shape[1] and shape_of(add.outputs[0]) == shape_of(out):
            return w, b.reshape(-1), add, add.outputs[0]
    return (w, None, None, out) if users.only(out) is not None else None


def _group(users: Users, x: Value) -> list[tuple[Node, tuple]]:
    """The projections of ``x`` that one node reads together (at most 3, in that node's order)."""
    projs = []
    for mm in users.of(x):
        p = projection(users, mm) if mm.op is N.MatMul and mm.inputs[0] is x else None
        if p is not None and users.only(p[3]) is not None:
            projs.append((mm, p))
    by_reader: dict[int, list] = {}
    for mm, p in projs:
        by_reader.setdefault(id(users.only(p[3])), []).append((mm, p))
    for grp in by_reader.values():
        reader = users.only(grp[0][1][3])
        if 2 <= len(grp) <= 3 and len({(p[0].shape[0], p[0].dtype, p[1] is None)
                                       for _, p in grp}) == 1:
            idx = {id(v): i for i, v in enumerate(reader.inputs)}
            return sorted(grp, key=lambda g: idx[id(g[1][3])])
    return []


def merge_group(graph: Graph, x: Value, grp: list, log: Callable[[str], None]) -> None:
    mms = [mm for mm, _ in grp]
    adds = [p[2] for _, p in grp if p[2] is not None]
    w = np.concatenate([p[0] for _, p in grp], axis=1)  # [Wq | Wk | Wv]
    sizes = tuple(int(p[0].shape[1]) for _, p in grp)
    first = min(graph.nodes.index(n) for n in mms + adds)
    s = shape_of(grp[0][1][3])
    wide = Value(graph.fresh_name("qkv"), _widened(grp[0][1][3], sum(sizes)))
    new = [Node(N.MatMul, " + ".join(n.name for n in mms), [x, add_const(graph, "qkv_w", w)],
                [wide])]
    if adds:
        b = np.concatenate([p[1] for _, p in grp])  # [bq | bk | bv]
        biased = Value(graph.fresh_name("qkv_b"), wide.type)
        new.append(Node(M.Add, " + ".join(n.name for n in adds),
                        [wide, add_const(graph, "qkv_b", b)], [biased]))
        wide = biased
    outs = [Value(p[3].name, p[3].type) for _, p in grp]
    new.append(Node(T.Split, new[-1].name + " (split)", [wide], outs,
                    T.Split.make_attrs(axis=len(s) - 1, split=sizes, n_out=len(outs))))
    for old, (_, p) in zip(outs, grp):
        replace_uses(graph, p[3], old)
    dead = {id(n) for n in mms + adds}
    graph.nodes[first:first] = new
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    log(f"fused {' + '.join(n.name for n in mms + adds)} -> MatMul [K, {sum(sizes)}] + Split")


def _widened(v: Value, n: int):
    from kiln.ir import TensorType

    s = shape_of(v)
    return TensorType(v.type.dtype, (*s[:-1], n))


def fuse_qkv(graph: Graph, log: Callable[[str], None]) -> int:
    """Projections of one input read together -> MatMul(x, [Wq|Wk|Wv]) (+ bias) -> Split."""
    users, n = Users(graph), 0
    for x in list(graph.values()):
        if len(users.of(x)) < 2 or shape_of(x) is None:
            continue
        grp = _group(users, x)
        if grp:
            merge_group(graph, x, grp, log)
            users.refresh()
            n += 1
    return n


PASSES = [("fuse_qkv", fuse_qkv)]
