"""Fusion: fold a per-channel constant added to a convolution's output into its bias.

        x                                   x
        │                                   │
      Conv(W, b)                 ==>      Conv(W, b + c)          "conv + add"
        │                                   │
      Add(c) | Sub(c)                       y                     (Sub: b - c)
        │
        y

Paddle's exports write a conv's bias as its own ``Add`` (a Conv without bias, then
``Add(y, c[1, K, 1, 1])``). Folded, the conv reads as the one op the other fusions match: the
two convs of a squeeze-excite block (``squeeze_excite``), a conv whose activation follows the
bias (``conv_bias_act`` takes a bias Add only for a conv that has none).

Fires only when the conv output feeds the Add alone (and is no graph output), W and c are
constants, c has one value (or one per output channel) and broadcasts along the channel axis
alone, so that the Add's result has the conv's shape. ``Sub(c, y)`` (the conv subtracted) does
not fire.

``fold_conv_mul`` (run before) folds a per-channel constant factor the same way:

        x                                   x
        │                                   │
      Conv(W, b)                 ==>      Conv(W * c, b * c)      "conv + mul"
        │                                   │
      Mul(c) | Div(c)                       y                     (Div: 1 / c)
        │
        y

PaddleOCR's PP-LCNetV3 writes a "learnable affine block" after its convs as ``Mul(scalar)``
then ``Add(scalar)``: with both folded, the conv's activation that follows fuses into it. The
same conditions hold (and ``Div(c, y)`` does not fire, nor a Div by a zero or a non-finite
factor).
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, TensorType
from kiln.ir.rewrite import insert_before, remove_nodes, single_user
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.passes.fusion.match import const_of


def channel_constant(c: np.ndarray | None, rank: int | None, channels: int) -> np.ndarray | None:
    """``c`` as [channels] float64 when it broadcasts over a rank-``rank`` [N, C, ...] tensor
    along C alone (one value, or C values on axis 1), else None."""
    if c is None or rank is None or c.dtype.kind != "f" or c.ndim > rank:
        return None
    if c.size == 1:
        return np.full(channels, float(c.reshape(-1)[0]))
    shape = (1,) * (rank - c.ndim) + tuple(c.shape)
    if shape[1] != channels or any(d != 1 for i, d in enumerate(shape) if i != 1):
        return None
    return np.asarray(c, dtype=np.float64).reshape(channels)


def _added(conv: Node, add: Node) -> np.ndarray | None:
    """The per-channel constant ``add`` adds to the conv's output (negated for a Sub)."""
    if len(add.inputs) != 2 or getattr(add.attrs, "broadcast", None):
        return None  # opset < 7 broadcasting aligns at ``axis``
    y = conv.outputs[0]
    if add.op is M.Sub and add.inputs[0] is not y:
        return None
    other = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
    if other is y:
        return None
    w = conv.inputs[1].const if conv.inputs[1] is not None else None
    if w is None or w.dtype.kind != "f":
        return None
    c = channel_constant(const_of(other), getattr(y.type, "rank", None), w.shape[0])
    return None if c is None else (-c if add.op is M.Sub else c)


def fold_conv_add(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for conv in [x for x in graph.nodes if x.op is N.Conv]:
        add = single_user(graph, conv.outputs[0], users)
        if add is None or add.op not in (M.Add, M.Sub):
            continue
        c = _added(conv, add)
        b_in = conv.inputs[2] if len(conv.inputs) > 2 else None
        if c is None or (b_in is not None and b_in.const is None):
            continue
        w_val = conv.inputs[1]
        b = c if b_in is None else np.asarray(b_in.const, np.float64).reshape(-1) + c
        b = b.astype(w_val.const.dtype)  # conv + add: b + c
        b2 = graph.add_weight(graph.fresh_name(f"{add.name}_bias"), b,
                              TensorType(w_val.type.dtype, b.shape))
        fused = Node(N.Conv, f"{conv.name} + {add.name}", [conv.inputs[0], w_val, b2],
                     [add.outputs[0]], conv.attrs)
        insert_before(graph, conv, fused)
        remove_nodes(graph, [conv, add])
        users = graph.users()
        log(f"fused {conv.name} + {add.name} -> Conv")
        n += 1
    return n


def _scaled(conv: Node, mul: Node) -> np.ndarray | None:
    """The per-channel factor ``mul`` multiplies the conv's output by (1/c for a Div)."""
    if len(mul.inputs) != 2 or getattr(mul.attrs, "broadcast", None):
        return None
    y = conv.outputs[0]
    if mul.op is M.Div and mul.inputs[0] is not y:
        return None
    other = mul.inputs[1] if mul.inputs[0] is y else mul.inputs[0]
    if other is y:
        return None
    w = conv.inputs[1].const if conv.inputs[1] is not None else None
    if w is None or w.dtype.kind != "f" or w.ndim < 3:
        return None
    c = channel_constant(const_of(other), getattr(y.type, "rank", None), w.shape[0])
    if c is None or not np.all(np.isfinite(c)) or (mul.op is M.Div and np.any(c == 0)):
        return None
    return 1.0 / c if mul.op is M.Div else c


def fold_conv_mul(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for conv in [x for x in graph.nodes if x.op is N.Conv]:
        mul = single_user(graph, conv.outputs[0], users)
        if mul is None or mul.op not in (M.Mul, M.Div):
            continue
        c = _scaled(conv, mul)
        b_in = conv.inputs[2] if len(conv.inputs) > 2 else None
        if c is None or (b_in is not None and b_in.const is None):
            continue
        w_val = conv.inputs[1]
        w = w_val.const
        w2 = (w.astype(np.float64) * c.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        ins = [conv.inputs[0], graph.add_weight(graph.fresh_name(f"{w_val.name}_scaled"), w2,
                                                TensorType(w_val.type.dtype, w2.shape))]
        if b_in is not None:
            b = (np.asarray(b_in.const, np.float64).reshape(-1) * c).astype(w.dtype)
            ins.append(graph.add_weight(graph.fresh_name(f"{mul.name}_bias"), b,
                                        TensorType(w_val.type.dtype, b.shape)))
        fused = Node(N.Conv, f"{conv.name} + {mul.name}", ins, [mul.outputs[0]], conv.attrs)
        insert_before(graph, conv, fused)
        remove_nodes(graph, [conv, mul])
        users = graph.users()
        log(f"fused {conv.name} + {mul.name} -> Conv")
        n += 1
    return n


PASSES = [("fold_conv_mul", fold_conv_mul), ("fold_conv_add", fold_conv_add)]
