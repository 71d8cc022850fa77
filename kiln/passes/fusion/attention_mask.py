"""Fusion (CUDA builds): an attention's additive 0 / -inf mask as the boolean keep-mask it was
made from, at the key-padding shape it started at.

    keep ──Where(keep, 0, -inf)──▶ m ──▶ Attention(q, k, v, m)  ==>  Attention(q, k, v, keep)
    keep = And(c, x), c a constant all True               ==>  keep = x (unbroadcast)

Hugging Face's SDPA exports (transformers 5: BERT, RoBERTa, ...) build the mask as
``And(<all-True [1, 1, Sq, 1] once the profile fixes Sq>, <key padding [B, 1, 1, Sk]>)`` and
turn it into an additive float mask with ``Where(keep, 0, -inf)``: a dense [B, 1, Sq, Sk] float
tensor that each layer's attention reads in full (BERT-base b64: 2 MB, once per head), and a
mask kind cuDNN's SDPA ran 2x slower with than with none. The CUDA attention kernels take a
boolean keep-mask as SDPA defines it (True: attend), and broadcast a [B, 1, 1, Sk] one through
zero strides, so the Where and the all-True And are dropped: a masked key's logit is -inf either
way (a fully masked row: the same result from the same kernels).

Fires on non-causal Attention nodes (a causal one folds its triangle into an additive mask)
whose mask is ``Where(b, 0, x)`` with ``b`` boolean, 0 and x <= -1e3 scalar constants (exp of
such a logit underflows to 0, as -inf's does); the And is dropped only where its constant is
all True and the other operand broadcasts to its output (so to the scores). The Where and And
stay where something else reads them. CPU builds keep the graph as it is (their attention
kernels were tuned on the additive mask).
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Value
from kiln.ir.dtype import DType
from kiln.ir.rewrite import remove_nodes
from kiln.ops import fused_transformer as FT
from kiln.ops import math as M
from kiln.passes.fusion.attention import BIG_NEGATIVE
from kiln.passes.fusion.match import const_of, made_by, scalar_of, shape_of


def _is_bool(v: Value) -> bool:
    return getattr(v.type, "dtype", None) is DType.bool


def keep_mask(m: Value) -> Value | None:
    """``m = Where(keep, 0, -big)`` with a boolean ``keep`` -> keep."""
    w = made_by(m, M.Where)
    if w is None or not _is_bool(w.inputs[0]):
        return None
    zero, big = scalar_of(w.inputs[1]), scalar_of(w.inputs[2])
    if zero != 0.0 or big is None or big > BIG_NEGATIVE:
        return None
    return w.inputs[0]


def _broadcasts_to(small, out) -> bool:
    if small is None or out is None or len(small) > len(out):
        return False
    return all(s is not None and (s == 1 or s == o)  # a symbolic dim: the same symbol
               for s, o in zip(reversed(small), reversed(out)))


def unbroadcast(keep: Value) -> Value:
    """``keep = And(c, x)`` with a constant all-True ``c`` and ``x`` boolean, broadcasting to
    keep's shape -> x; else keep."""
    a = made_by(keep, M.And)
    if a is None:
        return keep
    for c, x in ((a.inputs[0], a.inputs[1]), (a.inputs[1], a.inputs[0])):
        cv = const_of(c)
        if cv is not None and cv.dtype == np.bool_ and cv.all() and const_of(x) is None \
                and _is_bool(x) and _broadcasts_to(shape_of(x), shape_of(keep)):
            return x
    return keep


def fuse_attention_keep_mask(graph: Graph, log) -> int:
    """Rewire each matching Attention's mask; logs one line per mask (the layers of a model
    share theirs). Returns the Attention nodes rewired."""
    done: dict[int, list] = {}  # id(old mask) -> [old, new, the value unbroadcast, count]
    for att in [x for x in graph.nodes if x.op is FT.Attention]:
        m = att.inputs[3] if len(att.inputs) > 3 else None
        if m is None or att.attrs.causal:
            continue
        keep = keep_mask(m)
        if keep is None:
            continue
        new = unbroadcast(keep)
        att.inputs[3] = new
        done.setdefault(id(m), [m, new, keep, 0])[3] += 1
    for m, new, keep, count in done.values():
        log(f"attention mask '{m.name}' -> keep-mask '{new.name}'"
            + (f" (unbroadcast from '{keep.name}')" if new is not keep else "")
            + f", {count} attention node(s)")
    if done:
        _remove_dead(graph)
    return sum(d[3] for d in done.values())


def _remove_dead(graph: Graph) -> None:
    """Drop the Where / And nodes nothing reads any more."""
    while True:
        users = graph.users()
        outs = {id(v) for v in graph.outputs}
        dead = [x for x in graph.nodes if x.op in (M.Where, M.And)
                and all(not users.get(id(o)) and id(o) not in outs for o in x.outputs)]
        if not dead:
            return
        remove_nodes(graph, dead)


PASSES = [("fuse_attention_keep_mask", fuse_attention_keep_mask)]
