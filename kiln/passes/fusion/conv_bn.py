"""Fusion: fold an inference-mode BatchNormalization into the convolution before it.

        x                                   x
        │                                   │
      Conv(W, b)                 ==>      Conv(W * s, (b - mean) * s + beta)     "conv + bn"
        │                                   │
      BatchNormalization(gamma, beta,       y          s = gamma / sqrt(var + eps)
        │                mean, var)
        y

Fires only when the conv output feeds the BN alone (and is no graph output), W, b and the four
BN tensors are constants, the BN is in inference form (one output, per-channel ``spatial``),
and the parameters have one value per output channel. The arithmetic is done in float64 and the
result cast back to the weight's dtype.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, TensorType
from kiln.ir.rewrite import insert_before, remove_nodes, single_user
from kiln.ops import nn as N


def _bn_params(bn: Node, channels: int) -> list[np.ndarray] | None:
    """gamma, beta, mean, var as float64 [C], or None when they are not per-channel constants."""
    if len(bn.outputs) != 1 or getattr(bn.attrs, "training_mode", 0):
        return None
    if getattr(bn.attrs, "spatial", 1) not in (None, 1):
        return None
    vals = [v.const if v is not None else None for v in bn.inputs[1:5]]
    if len(vals) != 4 or any(c is None or c.size != channels for c in vals):
        return None
    return [np.asarray(c, dtype=np.float64).reshape(channels) for c in vals]


def _folded(conv: Node, bn: Node) -> tuple[np.ndarray, np.ndarray] | None:
    w = conv.inputs[1].const if conv.inputs[1] is not None else None
    if w is None or w.ndim < 3 or w.dtype.kind != "f":
        return None
    b_in = conv.inputs[2] if len(conv.inputs) > 2 else None
    if b_in is not None and b_in.const is None:
        return None
    c = w.shape[0]
    params = _bn_params(bn, c)
    if params is None:
        return None
    gamma, beta, mean, var = params
    # Conv(x, W) -> BN -> Conv(x, W*s) + (b - mean)*s + beta, s = gamma / sqrt(var + eps)
    s = gamma / np.sqrt(var + float(bn.attrs.epsilon if bn.attrs.epsilon is not None else 1e-5))
    b = np.zeros(c) if b_in is None else np.asarray(b_in.const, np.float64).reshape(c)
    w2 = (w.astype(np.float64) * s.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
    return w2, ((b - mean) * s + beta).astype(w.dtype)


def _drop_unused(graph: Graph, values, users: dict) -> None:
    for v in values:
        if v is not None and len(users.get(id(v), [])) <= 1 and graph.weights.get(v.name) is v:
            del graph.weights[v.name]


def fold_conv_bn(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for conv in [x for x in graph.nodes if x.op is N.Conv]:
        bn = single_user(graph, conv.outputs[0], users)
        if bn is None or bn.op is not N.BatchNormalization or bn.inputs[0] is not conv.outputs[0]:
            continue
        folded = _folded(conv, bn)
        if folded is None:
            continue
        w_val = conv.inputs[1]
        w2 = graph.add_weight(graph.fresh_name(f"{w_val.name}_bn"), folded[0],
                              TensorType(w_val.type.dtype, folded[0].shape))
        b2 = graph.add_weight(graph.fresh_name(f"{bn.name}_bias"), folded[1],
                              TensorType(w_val.type.dtype, folded[1].shape))
        fused = Node(N.Conv, f"{conv.name} + {bn.name}", [conv.inputs[0], w2, b2],
                     [bn.outputs[0]], conv.attrs)
        insert_before(graph, conv, fused)
        remove_nodes(graph, [conv, bn])
        _drop_unused(graph, conv.inputs[1:] + bn.inputs[1:], users)
        log(f"fused {conv.name} + {bn.name} -> Conv")
        n += 1
    return n


PASSES = [("fold_conv_bn", fold_conv_bn)]
