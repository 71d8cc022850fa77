"""Fusion (CPU builds): the Split of a merged Q/K/V projection folded into the attention that
reads its three parts.

    MatMul(x, [Wq|Wk|Wv]) + b ── Split ── q, k, v ── Attention(q, k, v, mask)
                         ==>  MatMul(x, [Wq|Wk|Wv]) + b ── Attention(qkv, -, -, mask, qkv_split)

The attention kernel takes q, k and v as views of the projection's output, so the Split step
(a PyTorch call of its own, which costs about as much as a small op on the CPU) goes. Fires
only when the Split cuts the last axis into exactly the attention's q, k and v (in that order),
with known sizes, and nothing else reads its outputs.
"""

from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.ir.rewrite import remove_nodes, single_user
from kiln.ops import fused_transformer as FT
from kiln.ops import tensor as T
from kiln.passes.fusion.match import made_by


def _match(graph: Graph, att: Node, users: dict) -> Node | None:
    if not att.attrs.num_heads or att.attrs.qkv_split or len(att.inputs) < 3:
        return None
    q, k, v = att.inputs[:3]
    if q is None or k is None or v is None:
        return None
    split = made_by(q, T.Split)
    if split is None or len(split.outputs) != 3:
        return None
    if any(a is not b for a, b in zip(split.outputs, (q, k, v))):  # q, k, v in that order
        return None
    shape = getattr(split.inputs[0].type, "shape", None)
    sizes = split.attrs.split
    if shape is None or sizes is None or len(sizes) != 3 or len(split.inputs) != 1:
        return None
    if split.attrs.axis not in (-1, len(shape) - 1):
        return None
    if any(single_user(graph, o, users) is not att for o in split.outputs):
        return None
    return split


def fold_qkv_split(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for att in [x for x in graph.nodes if x.op is FT.Attention]:
        split = _match(graph, att, users)
        if split is None:
            continue
        att.inputs = [split.inputs[0], None, None, *att.inputs[3:]]
        att.attrs = FT.Attention.make_attrs(**{**vars(att.attrs),
                                               "qkv_split": list(split.attrs.split)})
        remove_nodes(graph, [split])
        log(f"folded {split.name} into {att.name}")
        users = graph.users()
        n += 1
    return n


PASSES = [("fold_qkv_split", fold_qkv_split)]
