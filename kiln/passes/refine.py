"""Shape refinement: re-run the shape rules once folding has made more inputs constant.

The frontend infers every type once, at import. Folding then turns values into constants that
were unknown then (a Concat of shape pieces, once the profile fixed the dims they come from),
but the nodes reading them keep the types inferred without them::

    Expand(mask [1,1,128,128], Where(Equal(s, -1), 1, s))  ->  bool[?,?,?,?]  at import
    the Where folds to [1, 1, 128, 128]                      ->  bool[1,1,128,128] refined

``refine_shapes`` walks the graph in order and asks each node's rule again, keeping any dim or
symbolic value it now knows better (an int where there was ``?`` or a symbol). What it learns
lets ``fold_constants`` fold the next layer of shape arithmetic; the two run to a fixed point.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy

from kiln.ir import Graph, InferCtx, Node, TensorType
from kiln.passes import fold

MAX_ROUNDS = 8  # each round folds one more layer of shape arithmetic; exports need 2-3


def refine_shapes(graph: Graph, log: Callable[[str], None]) -> int:
    """Re-infer every node's output types; returns how many values got a sharper type."""
    n = 0
    for node in graph.nodes:
        if node.op.infer is None or node.subgraphs():
            continue
        for v, (t, s) in zip(node.outputs, _infer(node)):
            if isinstance(v.type, TensorType) and isinstance(t, TensorType):
                better = _sharper(v.type, t)
                if better is not None:
                    log(f"refined {v.name}: {v.type} -> {better}")
                    v.type, n = better, n + 1
            if s is not None and _sym_better(v.sym, s):
                v.sym = s
    return n


def _infer(node: Node) -> list:
    ins = node.inputs
    ctx = InferCtx(node.attrs, [v.type if v is not None else None for v in ins],
                   [v.const if v is not None else None for v in ins],
                   [v.sym if v is not None else None for v in ins], len(node.outputs))
    try:
        types = list(node.op.infer(ctx))
    except Exception:  # a rule that cannot cope here leaves the import's types
        return []
    syms = list(ctx.out_syms) + [None] * (len(types) - len(ctx.out_syms))
    return list(zip(types, syms))


def _sharper(old: TensorType, new: TensorType) -> TensorType | None:
    """``old`` with what ``new`` knows better, or None when it adds nothing (or disagrees)."""
    if new.dtype is not None and old.dtype is not None and new.dtype != old.dtype:
        return None
    dtype = old.dtype or new.dtype
    if new.shape is None:
        return TensorType(dtype, old.shape) if dtype != old.dtype else None
    if old.shape is None:
        return TensorType(dtype, new.shape)
    if len(old.shape) != len(new.shape):
        return None
    dims = []
    for a, b in zip(old.shape, new.shape):
        if isinstance(a, int) and isinstance(b, int) and a != b:
            return None  # the rules disagree with the import: trust neither, change nothing
        dims.append(b if _dim_better(a, b) else a)
    out = TensorType(dtype, tuple(dims))
    return out if out != old else None


def _dim_better(a, b) -> bool:
    if b is None or isinstance(a, int):
        return False
    return a is None or isinstance(b, int) or (
        isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr) and
        len(b.free_symbols) < len(a.free_symbols))


def _sym_better(old, new) -> bool:
    if old is None:
        return True
    if len(old) != len(new):
        return False
    return any(_dim_better(a, b) for a, b in zip(old, new))


def fold_to_fixed_point(graph: Graph, log: Callable[[str], None]) -> int:
    """``fold_constants`` and ``refine_shapes`` in turn until neither finds anything new."""
    total = 0
    for _ in range(MAX_ROUNDS):
        folded = fold.fold_constants(graph, log)
        refined = sum(refine_shapes(g, log) for g in fold.graph_and_subgraphs(graph))
        total += folded + refined
        if not refined:
            break
    return total


PASSES = [("fold_to_fixed_point", fold_to_fixed_point)]
