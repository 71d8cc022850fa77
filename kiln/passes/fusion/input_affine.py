"""Fusion: fold a per-channel affine map of a convolution's input into the convolution.

Folds a per-channel affine map of a convolution's *input* into it, where
the conv has no padding (a padded border would read zeros, not the mapped zeros) and one group:

      Mul(s) -> Add(t) -> Conv(W, b)   ==>   Conv(W * s[c], b + sum_{c, taps} W t[c])

(either op alone, in either order; ``Sub(x, t)`` as ``Add(-t)``, ``Div(x, s)`` as ``Mul(1/s)``).
PP-LCNetV3's affine block after an activation feeds its pointwise (1x1) convs so. The map's
result must feed the conv alone.

It runs after the activation fusions, so that the map's ops that are part of an activation
(HardSwish's ``Div(6)``) are no longer loose Mul/Div nodes.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, TensorType
from kiln.ir.rewrite import insert_before, remove_nodes, single_user
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.passes.fusion.conv_bias import channel_constant
from kiln.passes.fusion.match import const_of


def _unpadded(conv: Node, rank: int | None) -> bool:
    a = conv.attrs
    if (a.group or 1) != 1 or rank is None or (a.auto_pad or "NOTSET") not in ("NOTSET", "VALID"):
        return False
    return a.auto_pad == "VALID" or not any(a.pads or [])


def _input_map(conv: Node, op: Node) -> tuple[str, np.ndarray] | None:
    """("mul" | "add", the per-input-channel constant) of the map ``op`` applies to the conv's
    input, else None."""
    if op.op not in (M.Mul, M.Div, M.Add, M.Sub) or len(op.inputs) != 2 \
            or getattr(op.attrs, "broadcast", None):
        return None
    w = conv.inputs[1].const if conv.inputs[1] is not None else None
    if w is None or w.dtype.kind != "f" or w.ndim < 3:
        return None
    x = op.outputs[0]
    rank = getattr(x.type, "rank", None)
    for pos in (0, 1):
        if pos == 1 and op.op in (M.Div, M.Sub):
            break  # (c / x, c - x: no affine map of x)
        c = channel_constant(const_of(op.inputs[1 - pos]), rank, w.shape[1])
        if c is None or const_of(op.inputs[pos]) is not None or not np.all(np.isfinite(c)):
            continue
        if op.op is M.Div:
            return None if np.any(c == 0) else ("mul", 1.0 / c)
        if op.op is M.Sub:
            return "add", -c
        return ("mul" if op.op is M.Mul else "add"), c
    return None


def fold_input_affine(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    todo = [x for x in graph.nodes if x.op is N.Conv]
    while todo:
        conv = todo.pop()
        x = conv.inputs[0]
        op = x.producer if x is not None else None
        if op is None or not _unpadded(conv, getattr(x.type, "rank", None)) \
                or single_user(graph, x, users) is not conv:
            continue
        found = _input_map(conv, op)
        b_in = conv.inputs[2] if len(conv.inputs) > 2 else None
        if found is None or (b_in is not None and b_in.const is None):
            continue
        kind, c = found
        src = op.inputs[0] if const_of(op.inputs[1]) is not None else op.inputs[1]
        w_val = conv.inputs[1]
        w = w_val.const.astype(np.float64)
        k_out = w.shape[0]
        b = np.zeros(k_out) if b_in is None else np.asarray(b_in.const, np.float64).reshape(-1)
        if kind == "mul":
            w = w * c.reshape(1, -1, *([1] * (w.ndim - 2)))
        else:
            b = b + (w.reshape(k_out, w.shape[1], -1).sum(-1) * c).sum(1)
        dt = w_val.const.dtype
        w2 = graph.add_weight(graph.fresh_name(f"{w_val.name}_in"), w.astype(dt),
                              TensorType(w_val.type.dtype, w.shape))
        b2 = graph.add_weight(graph.fresh_name(f"{conv.name}_in_bias"), b.astype(dt),
                              TensorType(w_val.type.dtype, b.shape))
        fused = Node(N.Conv, f"{op.name} + {conv.name}", [src, w2, b2], list(conv.outputs),
                     conv.attrs)
        insert_before(graph, conv, fused)
        remove_nodes(graph, [op, conv])
        users = graph.users()
        log(f"fused {op.name} + {conv.name} -> Conv")
        todo.append(fused)  # the map before this one, if any
        n += 1
    return n


PASSES = [("fold_input_affine", fold_input_affine)]
