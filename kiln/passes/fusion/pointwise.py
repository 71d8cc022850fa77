"""Chains of elementwise ops -> one kiln::FusedPointwise holding the chain as a sub-program.

    a ──Sub(1, a)──▶ t ──Mul(t, -10000)──▶ y      becomes    FusedPointwise[Sub, Mul](a) ──▶ y

A chain grows through values read by exactly one node, and only while every step keeps the
shape of the chain's first result (a constant or other operand may broadcast into it, never the
other way), so the group computes one output of one shape. On the CPU the program runs as the
same torch ops in one launch record; the point is the CUDA backend, which generates one kernel
per group. Runs after the GEMM/conv epilogue fusions, so it only takes what they left.
"""

from __future__ import annotations

import json
from typing import Callable

from kiln.ir import Graph, Node, Value
from kiln.ops import fused_transformer as FT
from kiln.ops import math as M
from kiln.passes.fusion.match import Users, replace, same_dim, shape_of

UNARY = {M.Relu, M.Sigmoid, M.Tanh, M.Erf, M.Exp, M.Neg, M.Abs, M.Sqrt, M.Reciprocal}
BINARY = {M.Add, M.Sub, M.Mul, M.Div}  # ONNX broadcasting, one dtype in and out
# CUDA builds also take the boolean steps that build attention masks (And of a key-padding and
# a query-padding mask, then Where(mask, 0, -inf)): one generated kernel instead of PyTorch's
# logical_and and where, whose first launches in a fresh process cost ~15-20 ms each
MASK = {M.And, M.Or, M.Not, M.Xor, M.Equal, M.Less, M.Greater, M.LessOrEqual, M.GreaterOrEqual,
        M.Where}


def _float_or_bool(v: Value | None) -> bool:
    dt = getattr(getattr(v, "type", None), "dtype", None)
    return dt is not None and (dt.is_float or dt.name == "bool")


def _fusable(n: Node, masks: bool = False) -> bool:
    if len(n.outputs) != 1 or shape_of(n.outputs[0]) is None:
        return False
    if n.op in UNARY | BINARY:
        dt = getattr(n.outputs[0].type, "dtype", None)
        return dt is not None and dt.is_float
    return (masks and n.op in MASK and _float_or_bool(n.outputs[0])
            and all(_float_or_bool(v) for v in n.inputs))


def _same_shape(a: Value, b: Value) -> bool:
    sa, sb = shape_of(a), shape_of(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(
        same_dim(x, y) for x, y in zip(sa, sb))


def grow_chain(users: Users, start: Node, masks: bool = False) -> list[Node]:
    """``start`` and the elementwise nodes after it, each the only reader of the one before."""
    chain = [start]
    while True:
        nxt = users.only(chain[-1].outputs[0])
        if nxt is None or not _fusable(nxt, masks) or not _same_shape(nxt.outputs[0],
                                                               start.outputs[0]):
            return chain
        if sum(v is chain[-1].outputs[0] for v in nxt.inputs) != 1:
            return chain  # Mul(t, t): keep it simple, the program reads each step once
        chain.append(nxt)


def program_of(chain: list[Node]) -> tuple[list, list[Value]]:
    """The JSON-able steps of ``chain`` and the external values they read, in order."""
    made = {id(n.outputs[0]): i for i, n in enumerate(chain)}
    ext: list[Value] = []
    steps = []
    for n in chain:
        refs = []
        for v in n.inputs:
            if id(v) in made:
                refs.append(f"s{made[id(v)]}")
                continue
            if not any(v is e for e in ext):
                ext.append(v)
            refs.append(f"i{next(i for i, e in enumerate(ext) if e is v)}")
        steps.append([n.op.name, refs])
    return steps, ext


def fuse_pointwise(graph: Graph, log: Callable[[str], None], masks: bool = False) -> int:
    """Chains of 2+ elementwise ops (single reader, no shape growth) -> FusedPointwise;
    ``masks``: the boolean mask steps too (:data:`MASK`)."""
    users, n = Users(graph), 0
    for start in list(graph.nodes):
        if start not in graph.nodes or not _fusable(start, masks):
            continue
        prev = [u for v in start.inputs if v is not None and v.producer is not None
                for u in [v.producer] if _fusable(u, masks) and users.only(v) is start]
        if prev and any(_same_shape(p.outputs[0], start.outputs[0]) for p in prev):
            continue  # not the head of its chain: the head's scan takes this node
        chain = grow_chain(users, start, masks)
        if len(chain) < 2:
            continue
        steps, ext = program_of(chain)
        attrs = FT.FusedPointwise.make_attrs(program=json.dumps(steps))
        label = "FusedPointwise[" + ", ".join(s[0] for s in steps) + "]"
        replace(graph, chain, FT.FusedPointwise, ext, attrs, chain[-1].outputs[0], log, label)
        users.refresh()
        n += 1
    return n


def fuse_pointwise_masks(graph: Graph, log: Callable[[str], None]) -> int:
    return fuse_pointwise(graph, log, masks=True)


PASSES = [("fuse_pointwise", fuse_pointwise)]
CUDA_PASSES = [("fuse_pointwise", fuse_pointwise_masks)]  # the generated kernel takes MASK
