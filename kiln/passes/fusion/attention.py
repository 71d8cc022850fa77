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

Hugging Face's SDPA path, as torch.onnx exports it, differs in three ways, all absorbed:

    Q ──Mul(c)──┐                           the scale split as c = 1/√√D on each side
    Kᵀ ─Mul(c)──┴─MatMul ─Add(Where(mask, 0, -inf)) ─Softmax ─▶ p
    p ─IsNaN─▶ Where(·, 0, p) ─MatMul(V)      "safe softmax": a fully masked row gives zeros

The guard is what the fused kernels do anyway (a row whose scores are all -inf comes out as
zeros), so it goes; the two Muls multiply into ``scale``. ``fuse_attention`` logs each Softmax
that feeds a MatMul but does not fuse as ``not fused: attention at <node>: <reason>``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.ops import fused_transformer as FT
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.match import (
    Users,
    const_of,
    made_by,
    reject,
    replace,
    same_dim,
    scalar_of,
    shape_of,
    split_const,
)

BIG_NEGATIVE = -1e3  # a masked logit at or below this underflows exp(): the same as -inf


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


def is_causal_bias(c: np.ndarray, factor: float) -> bool:
    # 0 where j <= i, -big above the diagonal (``factor``: a scale applied after the add)
    keep = np.tri(*c.shape, dtype=bool)
    return c.dtype.kind == "f" and np.all(c[keep] == 0) and np.all(
        c[~keep] * factor <= BIG_NEGATIVE)


def _causal_operand(v: Value, scores: Value, keep: bool, factor: float) -> list[Node] | None:
    """The nodes producing ``v`` when it is a causal mask covering ``scores``' last two dims."""
    got = sliced_const(v, 4)
    vs, ss = shape_of(v), shape_of(scores)
    if got is None or vs is None or ss is None or len(vs) < 2:
        return None
    if not (same_dim(vs[-1], ss[-1]) and same_dim(vs[-2], ss[-2])):
        return None  # a broadcast mask (one row or column) is not causal
    ok = is_causal_keep(got[0]) if keep else is_causal_bias(got[0], factor)
    return got[1] if ok else None


class Core:
    """What the walk from Softmax back to the first MatMul found."""

    def __init__(self):
        self.scale, self.causal, self.mask = 1.0, False, None
        self.nodes: list[Node] = []
        self.qk: Node | None = None
        self.why: list[str] = []  # shared by the trial copies: the first reason a walk stopped


def _walk(v: Value, core: Core, users: Users, after_scale: bool) -> Core | None:
    """Walk from the Softmax input back to MatMul(Q, Kᵀ), collecting scale and masks.
    Every value passed on the way must be read by the next node only."""
    p = v.producer
    if p is None:
        return _stop(core, f"'{v.name}' is not computed by a node")
    if users.only(v) is None:
        return _stop(core, f"'{v.name}' is also read outside the attention")
    if p.op is N.MatMul:
        core.qk = p
        return core
    if p.op in (M.Div, M.Mul) and not after_scale:
        s = scalar_of(p.inputs[1])
        if s is not None and s != 0:  # x / c -> scale 1/c;  x * c -> scale c
            core.scale *= (1.0 / s) if p.op is M.Div else s
            return _step(p, p.inputs[0], core, users, True)
        if p.op is M.Mul and scalar_of(p.inputs[0]) not in (None, 0.0):
            core.scale *= scalar_of(p.inputs[0])
            return _step(p, p.inputs[1], core, users, True)
        return _stop(core, f"{p.op.name} '{p.name}' scales the scores by a tensor, not a scalar")
    factor = core.scale if after_scale else 1.0  # a mask before the scale gets scaled
    if p.op is M.Where and not core.causal and scalar_of(p.inputs[2]) is not None:
        if scalar_of(p.inputs[2]) * factor <= BIG_NEGATIVE and _causal_operand(
                p.inputs[0], p.outputs[0], True, factor) is not None:
            core.causal = True  # Where(keep, s, -big) -> causal
            return _step(p, p.inputs[1], core, users, after_scale)
        return _stop(core, f"Where '{p.name}' on the scores is not a constant causal mask")
    if p.op is M.Add:
        return _walk_add(p, core, users, after_scale)
    return _stop(core, f"{p.op.name} '{p.name}' between the MatMul and the Softmax is not a "
                       "scale or a mask")


def _stop(core: Core, why: str) -> None:
    if why and not core.why:
        core.why.append(why)
    return None


def _step(p: Node, nxt: Value, core: Core, users: Users, after_scale: bool) -> Core | None:
    core.nodes.append(p)
    return _walk(nxt, core, users, after_scale)


def _is_scores_side(ss, out, ms) -> bool:
    """Is an operand of shape ``ss`` the scores of an Add of result ``out`` with ``ms``? Its
    dims must be the result's: the mask may broadcast, never the other way. A result dim that
    inference left unknown (a mask Expanded to a computed shape, as transformers' decode steps
    export it) counts where the scores' dim is known and the mask's is unknown, 1 or the same:
    a mask that did widen the scores would change the attention's result shape, which no
    exporter writes, and the fused kernels refuse such a mask at run time."""
    if ss is None or out is None or len(ss) != len(out):
        return False
    ms = [None] * (len(out) - len(ms or ())) + list(ms or ())
    return all(same_dim(a, b) or (b is None and a is not None and (
        m is None or str(m) == "1" or same_dim(m, a))) for a, b, m in zip(ss, out, ms))


def _walk_add(p: Node, core: Core, users: Users, after_scale: bool) -> Core | None:
    out = shape_of(p.outputs[0])
    for s, m in (p.inputs, p.inputs[::-1]):
        if not _is_scores_side(shape_of(s), out, shape_of(m)):
            continue  # s must be the scores: the mask may broadcast, never the other way
        factor = core.scale if after_scale else 1.0
        if not core.causal and _causal_operand(m, p.outputs[0], False, factor) is not None:
            trial = _copy(core)
            trial.causal = True  # s + causal bias -> causal
            got = _step(p, s, trial, users, after_scale)
            if got is not None:
                return got
        ms = shape_of(m)
        if core.mask is None and not after_scale and ms is not None and 2 <= len(ms) <= len(out):
            trial = _copy(core)  # only a mask of known rank >= 2 (SDPA's attn_mask broadcast)
            trial.mask = m  # s + mask -> additive mask
            got = _step(p, s, trial, users, after_scale)
            if got is not None:
                return got
    return _stop(core, f"Add '{p.name}': no operand is a mask of rank >= 2 that broadcasts over "
                       "the scores (or the mask comes before the scale)")


def _copy(core: Core) -> Core:
    c = Core()
    c.scale, c.causal, c.mask, c.nodes = core.scale, core.causal, core.mask, list(core.nodes)
    c.why = core.why
    return c


def probs_reader(users: Users, sm: Node) -> tuple[Node, list[Node]] | str | None:
    """The MatMul reading the Softmax's probabilities p, directly or through the safe-softmax
    guard ``Where(IsNaN(p), 0, p)``: (the MatMul, the guard's nodes); a reason when a MatMul
    reads them but so does something else; None when no MatMul does."""
    p = sm.outputs[0]
    pv = users.only(p)
    if pv is not None:
        return (pv, []) if pv.op is N.MatMul and pv.inputs[0] is p else None
    us = users.of(p)
    isnan = next((u for u in us if u.op is M.IsNaN), None)
    where = next((u for u in us if u.op is M.Where), None)
    if len(us) == 2 and isnan is not None and where is not None and where.inputs[0] is \
            isnan.outputs[0] and where.inputs[2] is p and scalar_of(where.inputs[1]) == 0.0 \
            and users.only(isnan.outputs[0]) is where:  # Where(IsNaN(p), 0, p) -> p
        pv = users.only(where.outputs[0])
        ok = pv is not None and pv.op is N.MatMul and pv.inputs[0] is where.outputs[0]
        return (pv, [isnan, where]) if ok else None
    if any(u.op is N.MatMul and u.inputs[0] is p for u in us):
        return (f"the probabilities '{p.name}' are also read outside the attention (a graph "
                "output, or another node)")
    return None


def peel_scale(users: Users, v: Value, core: Core) -> Value:
    """``v`` = Mul(x, c) or Div(x, c) read only by the QK MatMul -> x, with c in the scale
    (HF's SDPA export scales Q and Kᵀ by 1/√√D each)."""
    m = made_by(v, M.Mul, M.Div)
    got = split_const(m) if m is not None and users.only(v) is not None else None
    if got is None or got[1] == 0 or (m.op is M.Div and m.inputs[0] is not got[0]):
        return v
    x, c = got
    if shape_of(x) is None or len(shape_of(x)) != len(shape_of(v) or ()):
        return v  # the constant would broadcast x up a rank
    core.scale *= c if m.op is M.Mul else 1.0 / c  # (x * c) @ k -> scale c
    core.nodes.append(m)
    return x


def _perm(n: Node | None) -> tuple | None:
    return tuple(n.attrs.perm) if n is not None and n.attrs.perm is not None else None


def split_heads(users: Users, v: Value, perm: tuple) -> tuple[Value, list[Node], int] | None:
    """Transpose(perm)(Reshape(x3 [B,S,E] -> [B,S,H,D])) -> (x3, nodes, H)."""
    t = made_by(v, T.Transpose)
    r = made_by(t.inputs[0], T.Reshape) if t is not None and _perm(t) == perm else None
    if r is None or users.only(t.inputs[0]) is None or users.only(v) is None:
        return None
    x3, s4 = r.inputs[0], shape_of(r.outputs[0])
    s3 = shape_of(x3)
    if s3 is None or s4 is None or len(s3) != 3 or len(s4) != 4:
        return None
    if not (same_dim(s3[0], s4[0]) and same_dim(s3[1], s4[1])):
        return None
    h, d, e = s4[2], s4[3], s3[2]
    if not all(isinstance(x, int) for x in (h, d, e)) or h * d != e:
        return None
    return x3, [r, t], h


def batched_transpose(users: Users, v: Value) -> tuple[Value, list[Node]] | None:
    """Reshape(Transpose(Reshape(k [B,H,S,D] -> [B*H,S,D]), (0,2,1)) -> [B,H,D,S]) -> (k, nodes):
    ``k.transpose(-2, -1)`` as the dynamo exporter's SDPA decomposition writes it."""
    r2 = made_by(v, T.Reshape)
    t = made_by(r2.inputs[0], T.Transpose) if r2 is not None else None
    r1 = made_by(t.inputs[0], T.Reshape) if t is not None and _perm(t) == (0, 2, 1) else None
    if r1 is None or users.only(r1.outputs[0]) is not t or users.only(t.outputs[0]) is not r2:
        return None
    k = r1.inputs[0]
    ks, fs, out = shape_of(k), shape_of(r1.outputs[0]), shape_of(v)
    if ks is None or fs is None or out is None or (len(ks), len(fs), len(out)) != (4, 3, 4):
        return None
    ok = all(same_dim(a, b) for a, b in ((out[0], ks[0]), (out[1], ks[1]), (out[2], ks[3]),
                                         (out[3], ks[2]), (fs[1], ks[2]), (fs[2], ks[3])))
    return (k, [r1, t, r2]) if ok else None


def key_heads(users: Users, kt: Value) -> tuple[Value, list[Node], int] | None:
    """split_heads for Kᵀ: one Transpose(0,2,3,1), or Transpose(0,2,1,3) then the dynamo
    exporter's batched transpose of the last two axes."""
    got = split_heads(users, kt, (0, 2, 3, 1))
    bt = batched_transpose(users, kt) if got is None and users.only(kt) is not None else None
    inner = split_heads(users, bt[0], (0, 2, 1, 3)) if bt is not None else None
    return got if inner is None else (inner[0], inner[1] + bt[1], inner[2])


def merge_heads(users: Users, v: Value) -> tuple[Value, list[Node]] | None:
    """Reshape(Transpose(0,2,1,3)(y [B,H,S,D]) -> [B,S,H*D]) -> (the Reshape's output, nodes)."""
    t = users.only(v)
    if t is None or t.op is not T.Transpose or _perm(t) != (0, 2, 1, 3):
        return None
    r = users.only(t.outputs[0])
    if r is None or r.op is not T.Reshape:
        return None
    s4, s3 = shape_of(t.outputs[0]), shape_of(r.outputs[0])
    if s4 is None or s3 is None or len(s3) != 3 or len(s4) != 4:
        return None
    ok = same_dim(s3[0], s4[0]) and same_dim(s3[1], s4[1]) and isinstance(s3[2], int) and \
        isinstance(s4[2], int) and isinstance(s4[3], int) and s3[2] == s4[2] * s4[3]
    return (r.outputs[0], [t, r]) if ok else None


def match_attention(users: Users, sm: Node):
    """Softmax node -> (inputs, attrs, nodes, out) of the fused Attention, a reason string when
    the Softmax feeds a MatMul but the rest does not match, or None when it is no candidate."""
    rank = _rank(sm.inputs[0])
    axis = sm.attrs.axis if sm.attrs.axis is not None else -1
    if rank is None or rank < 3 or axis % rank != rank - 1:
        return None
    got = probs_reader(users, sm)
    if got is None or isinstance(got, str):
        return got
    pv, guard = got
    start = Core()
    core = _walk(sm.inputs[0], start, users, False)
    if core is None:
        return "the scores do not come from MatMul(Q, Kᵀ)" + (
            f": {start.why[0]}" if start.why else "")
    q, kt, v = peel_scale(users, core.qk.inputs[0], core), peel_scale(
        users, core.qk.inputs[1], core), pv.inputs[1]
    shapes = [shape_of(x) for x in (q, kt, v)]
    if any(s is None or len(s) != rank for s in shapes) or not all(
            same_dim(a, b) and same_dim(a, c) for a, b, c in zip(*[s[:-2] for s in shapes])):
        return "Q, K and V disagree on their batch and head dims (K/V broadcast over heads?)"
    nodes = [core.qk, *core.nodes, sm, *guard, pv]
    heads = [split_heads(users, q, (0, 2, 1, 3)), key_heads(users, kt),
             split_heads(users, v, (0, 2, 1, 3))]
    merged = merge_heads(users, pv.outputs[0])
    ins, num_heads, out = [q, kt, v], 0, pv.outputs[0]
    if merged and all(heads) and len({h[2] for h in heads}) == 1:
        ins, num_heads, out = [h[0] for h in heads], heads[0][2], merged[0]
        nodes += [n for h in heads for n in h[1]] + merged[1]
    if core.mask is not None:
        ins.append(core.mask)
    attrs = FT.Attention.make_attrs(num_heads=num_heads, scale=float(core.scale),
                                    causal=int(core.causal))
    return ins, attrs, nodes, out


def fuse_attention(graph: Graph, log: Callable[[str], None]) -> int:
    """MatMul -> scale -> masks -> Softmax -> MatMul (+ head split/merge) -> kiln::Attention."""
    users, n = Users(graph), 0
    for sm in list(graph.nodes):
        if sm.op is not N.Softmax or sm not in graph.nodes:
            continue
        dt = getattr(sm.outputs[0].type, "dtype", None)
        m = match_attention(users, sm) if dt is not None and dt.is_float else None
        if isinstance(m, str):
            reject(log, "attention", sm, m)
            continue
        if m is None:
            continue
        ins, attrs, nodes, out = m
        if not users.private(nodes, out):
            reject(log, "attention", sm, "a value inside the pattern is read outside it")
            continue
        replace(graph, nodes, FT.Attention, ins, attrs, out, log,
                label=f"Attention(heads={attrs.num_heads}, causal={attrs.causal})")
        users.refresh()
        n += 1
    return n


PASSES = [("fuse_attention", fuse_attention)]
