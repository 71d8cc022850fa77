"""Fusion (CPU): a scale and shift after a convolution's HardSwish, into its epilogue.

        x                                    x
        │                                    │
      FusedConv(activation=HardSwish)  ==>  FusedConv(activation=HardSwishAffine,
        │                                    │          alpha=s, beta=t)
      Mul(s) ─ Add(t)                        y          "conv + mul + add"
        │
        y

PaddleOCR's PP-LCNetV3 writes a "learnable affine block" (``Mul`` by one constant, then
``Add`` of one) after the HardSwish of its convolutions; where the block feeds a padded
(depthwise) conv, ``fold_input_affine`` cannot fold it there, and it was a pass of its own over
the activations. Here the kernels apply it to the tile in registers (``alpha * HardSwish(y) +
beta``). Either op alone, several in a row, ``Div(y, s)`` as ``Mul(1 / s)`` and ``Sub(y, t)`` as
``Add(-t)``. Fires only on one-element constants (of rank at most the conv output's), where
the conv's output (and each merged value) is read by the next op alone and is no graph output.
CPU only: the CUDA kernels do not have the epilogue.
"""

from __future__ import annotations

import math

from kiln.ir import Graph, Node
from kiln.ir.rewrite import insert_before, remove_nodes, single_user
from kiln.ops import fused_conv as FC
from kiln.ops import math as M
from kiln.passes.fusion.match import const_of


def _affine(y, op: Node) -> tuple[float, float] | None:
    """(scale, shift) of ``op`` applied to ``y``, for a one-element constant operand."""
    if op.op not in (M.Mul, M.Div, M.Add, M.Sub) or len(op.inputs) != 2 \
            or getattr(op.attrs, "broadcast", None):
        return None
    if op.inputs[0] is y:
        other = op.inputs[1]
    elif op.inputs[1] is y and op.op in (M.Mul, M.Add):
        other = op.inputs[0]
    else:
        return None
    c = const_of(other)
    rank = getattr(y.type, "rank", None)
    if c is None or c.size != 1 or c.dtype.kind != "f" or rank is None or c.ndim > rank:
        return None
    v = float(c.reshape(-1)[0])
    if not math.isfinite(v) or (op.op is M.Div and v == 0.0):
        return None
    return {M.Mul: (v, 0.0), M.Div: (1.0 / v, 0.0), M.Add: (1.0, v), M.Sub: (1.0, -v)}[op.op]


def fuse_act_affine(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    todo = [x for x in graph.nodes if x.op is FC.FusedConv
            and x.attrs.activation in ("HardSwish", "HardSwishAffine")]
    while todo:
        conv = todo.pop()
        y = conv.outputs[0]
        op = single_user(graph, y, users)
        found = None if op is None else _affine(y, op)
        if found is None:
            continue
        s, t = found
        a = conv.attrs
        alpha, beta = (a.alpha, a.beta) if a.activation == "HardSwishAffine" else (1.0, 0.0)
        attrs = FC.FusedConv.make_attrs(**{**vars(a), "activation": "HardSwishAffine",
                                           "alpha": alpha * s, "beta": beta * s + t})
        fused = Node(FC.FusedConv, f"{conv.name} + {op.name}", list(conv.inputs),
                     [op.outputs[0]], attrs)
        insert_before(graph, conv, fused)
        remove_nodes(graph, [conv, op])
        users = graph.users()
        log(f"fused {conv.name} + {op.name} -> FusedConv (HardSwishAffine)")
        todo.append(fused)
        n += 1
    return n


PASSES = [("fuse_act_affine", fuse_act_affine)]
