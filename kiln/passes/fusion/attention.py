"""Scaled dot-product attention -> one kiln::Attention (scaled_dot_product_attention on CPU).

What the exporters write (BERT, MiniLM, GPT-2), heads split and merged around the core::

    q3 ─Reshape[B,S,H,D]─Transpose(0,2,1,3)──▶ Q ─┐
    k3 ─Reshape[B,S,H,D]─Transpose(0,2,3,1)──▶ Kᵀ ┴─MatMul──▶ Div(c) | Mul(c)   (scale)
          ──▶ Where(causal, ·, -big) | Add(causal const) ──▶ Add(mask)         (each optional)
          ──▶ Softmax(last axis) ─┐
    v3 ─Reshape[B,S,H,D]─Transpose(0,2,1,3)──▶ V ─┴─MatMul─Transpose(0,2,1,3)─Reshape[B,S,E]─▶ y

becomes ``kiln::Attention(q3, k3, v3[, mask], num_heads=H, scale, causal)``: the per-head views
cost nothing, and the [B, H, S, S] score tensor is never written out. When the head split does
not match (a reader outside, other permutations) the core alone is fused
(``num_heads=0``: Q, Kᵀ, V in, per-head result out).

Causality is recognised only from constants: a lower-triangular keep-mask (Where) or a 0 / -big
additive mask (Add), optionally cut to [:Sq, :Sk] by Slices starting at 0 — exactly the top-left
aligned mask SDPA's ``is_causal`` applies. Any other Add operand stays an additive mask input; a
mask added before the scale is not fused (its effect would be scaled too).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.ops import fused_transformer as FT
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.match import (Users, const_of, made_by, replace, same_dim, scalar_of,
                                      shape_of)

BIG_NEGATIVE = -1e4  # a fill at or below this is exp()-underflow: the same as -inf


def _rank(v: Value) -> int | None:
    s = shape_of(v)
    return None if s is None else len(s)


def sliced_const(v: Value, rank: int) -> tuple[np.ndarray, list[Node]] | None:
    """A constant, possibly cut by Slices that start at 0 with step 1 on the last two axes:
    returns (the constant's last two dims, the Slice nodes)."""
    slices: list[Node] = []
    while const_of(v) is None:
        s = made_by(v, T.Slice)
        if s is None or len(s.inputs) < 3:
            return None
        c = [const_of(s.inputs[i]) if i < len(s.inputs) and s.inputs[i] is not None else None
             for i in (1, 3, 4)]
        starts, axes, steps = c
        n = 0 if starts is None else starts.size
        axes = np.arange(n) if axes is None else axes
        base_rank = _rank(s.inputs[0])
        if starts is None or base_rank is None or np.any(starts != 0) or (
                steps is not None and np.any(steps != 1)):
            return None
        if any((int(a) % base_rank) < base_rank - 2 for a in axes.reshape(-1)):
            return None
        slices.append(s)
        v = s.inputs[0]
    c = const_of(v)
    if c.ndim < 2 or any(d != 1 for d in c.shape[:-2]):
        return None
    return c.reshape(c.shape[-2:]), slices


def is_causal_keep(c: np.ndarray) -> bool:
    # keep[i, j] = j <= i  (what SDPA's is_causal keeps)
    return c.dtype == np.bool_ and np.array_equal(c, np.tri(*c.shape, dtype=bool))


def is_causal_bias(c: np.ndarray) -> bool:
    # 0 where j <= i, -big above the diagonal
    keep = np.tri(*c.shape, dtype=bool)
    return c.dtype.kind == "f" and np.all(c[keep] == 0) and np.all(c[~keep] <= BIG_NEGATIVE)


def _causal_operand(v: Value, scores: Value, keep: bool) -> list[Node] | None:
    """The nodes producing ``v`` when it is a causal mask covering ``scores``' last two dims."""
    got = sliced_const(v, 4)
    vs, ss = shape_of(v), shape_of(scores)
    if got is None or vs is None or ss is None or len(vs) < 2:
        return None
    if not (same_dim(vs[-1], ss[-1]) and same_dim(vs[-2], ss[-2])):
        return None  # a broadcast mask (one row or column) is not causal
    ok = is_causal_keep(got[0]) if keep else is_causal_bias(got[0])
    return got[1] if ok else None


class Core:
    """What the walk from Softmax back to the first MatMul found."""

    def __init__(self):
        self.scale, self.causal, self.mask = 1.0, False, None
        self.nodes: list[Node] = []
        self.qk: Node | None = None
