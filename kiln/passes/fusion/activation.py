"""Activations that exporters spell out in two or three ops -> the one ONNX op.

    x ──Softplus──Tanh──▶ t ─┐
    x ───────────────────────┴─Mul──▶ y       ==>  Mish(x)        (torch's Mish, every opset)

    x ──HardSigmoid(α=1/6, β=1/2)──▶ h ─┐
    x ──────────────────────────────────┴─Mul──▶ y   ==>  HardSwish(x)   (before opset 14)

One node instead of three or two; a HardSwish then fuses into the conv or GEMM before it as its
epilogue (``conv_bias_act``). Each value inside the pattern must be read by the next node
alone; the Mul's operands may come in either order.
"""

from __future__ import annotations

from typing import Callable

from kiln.ir import Graph, Node, Value
from kiln.ops import math as M
from kiln.passes.fusion.match import Users, made_by, replace


def mish_gate(users: Users, t: Value, x: Value) -> list[Node] | None:
    """``t = Tanh(Softplus(x))`` read only by the Mul -> [softplus, tanh]."""
    tanh = made_by(t, M.Tanh)
    sp = made_by(tanh.inputs[0], M.Softplus) if tanh is not None else None
    if sp is None or sp.inputs[0] is not x or users.only(sp.outputs[0]) is not tanh:
        return None
    return [sp, tanh]


def hardswish_gate(users: Users, h: Value, x: Value) -> list[Node] | None:
    """``h = HardSigmoid(x, alpha=1/6, beta=0.5)`` -> [hardsigmoid]."""
    hs = made_by(h, M.HardSigmoid)
    if hs is None or hs.inputs[0] is not x:
        return None
    a = hs.attrs
    alpha = 0.2 if a.alpha is None else a.alpha
    beta = 0.5 if a.beta is None else a.beta
    return [hs] if abs(alpha - 1 / 6) < 1e-6 and abs(beta - 0.5) < 1e-6 else None


pm_gated = [(mish_gate, M.Mish), (hardswish_gate, M.HardSwish)]  # x * gate(x) -> op(x)


def fuse_activations(graph: Graph, log: Callable[[str], None]) -> int:
    """Mul(x, Tanh(Softplus(x))) -> Mish(x); Mul(x, HardSigmoid(x, 1/6, 1/2)) -> HardSwish(x)."""
    users, n = Users(graph), 0
    for mul in list(graph.nodes):
        if mul.op is not M.Mul or mul not in graph.nodes or len(mul.inputs) != 2:
            continue
        for x, gate in (mul.inputs, mul.inputs[::-1]):
            if x is gate or users.only(gate) is not mul:
                continue
            got = next(((nodes, op) for match, op in pm_gated
                        if (nodes := match(users, gate, x)) is not None), None)
            if got is None:
                continue
            nodes = [*got[0], mul]
            if users.private(nodes, mul.outputs[0]):
                replace(graph, nodes, got[1], [x], got[1].make_attrs(), mul.outputs[0], log)
                users.refresh()
                n += 1
            break
    return n


PASSES = [("fuse_activations", fuse_activations)]
