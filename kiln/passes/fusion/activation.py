"""Activations that exporters spell out in two or three ops -> the one ONNX op.

    x ──Softplus──Tanh──▶ t ─┐
    x ───────────────────────┴─Mul──▶ y       ==>  Mish(x)        (torch's Mish, every opset)

    x ──HardSigmoid(α=1/6, β=1/2)──▶ h ─┐
    x ──────────────────────────────────┴─Mul──▶ y   ==>  HardSwish(x)   (before opset 14)

    x ──Add(3)──Clip(0, 6)──▶ r ──Div(6) | Mul(1/6)──▶ y   ==>  HardSigmoid(x, 1/6, 1/2)
    x ──Add(3)──Clip(0, 6)──▶ r ─┐
    x ───────────────────────────┴─Mul──Div(6) | Mul(1/6)──▶ y   ==>  HardSwish(x)
                                  (Paddle, and torch's ``x * F.relu6(x + 3) / 6``)

One node instead of three or two; a HardSwish then fuses into the conv or GEMM before it as its
epilogue (``conv_bias_act``). Each value inside the pattern must be read by the next node
alone; the Mul's operands may come in either order.
"""

from __future__ import annotations

from typing import Callable

from kiln.ir import Graph, Node, Value
from kiln.ops import math as M
from kiln.passes.fusion.match import (
    Users,
    is_scalar,
    made_by,
    other,
    replace,
    scalar_of,
    split_const,
)


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


def relu6_shifted(users: Users, r: Value) -> tuple[Value, list[Node]] | None:
    """``r = Clip(Add(x, 3), 0, 6)``, the Add read by the Clip alone -> (x, [add, clip])."""
    clip = made_by(r, M.Clip)
    add = made_by(clip.inputs[0], M.Add) if clip is not None else None
    if add is None or users.only(add.outputs[0]) is not clip or _bounds(clip) != (0.0, 6.0):
        return None
    got = split_const(add)
    if got is None or got[1] != 3.0:
        return None
    return got[0], [add, clip]


def _bounds(clip: Node) -> tuple | None:
    """(min, max) of a Clip with constant bounds (inputs from opset 11, attributes before)."""
    if len(clip.inputs) == 1:
        return clip.attrs.min, clip.attrs.max
    if len(clip.inputs) != 3:
        return None
    return scalar_of(clip.inputs[1]), scalar_of(clip.inputs[2])


def _sixth(users: Users, d: Node) -> Value | None:
    """For ``d`` = Div(v, 6) or Mul(v, 1/6) (either order): ``v``, read by ``d`` alone."""
    if len(d.inputs) != 2 or getattr(d.attrs, "broadcast", None):
        return None
    a, b = d.inputs
    if d.op is M.Div:
        v = a if is_scalar(b, 6.0, 1e-6) else None
    else:
        v = a if is_scalar(b, 1 / 6, 1e-6) else b if is_scalar(a, 1 / 6, 1e-6) else None
    return v if v is not None and users.only(v) is d else None


def match_hard_sixth(users: Users, d: Node):
    """(op, attrs, x, nodes) where ``d`` divides ``relu6(x + 3)`` (HardSigmoid) or
    ``x * relu6(x + 3)`` (HardSwish) by 6, else None."""
    v = _sixth(users, d)
    if v is None:
        return None
    got = relu6_shifted(users, v)
    if got is not None:
        attrs = M.HardSigmoid.make_attrs(alpha=1 / 6, beta=0.5)
        return M.HardSigmoid, attrs, got[0], [*got[1], d]
    mul = made_by(v, M.Mul)
    if mul is None or len(mul.inputs) != 2:
        return None
    for r in mul.inputs:
        got = relu6_shifted(users, r)
        if got is not None and other(mul, r) is got[0] and users.only(r) is mul:
            return M.HardSwish, M.HardSwish.make_attrs(), got[0], [*got[1], mul, d]
    return None


def fuse_hard_sixths(graph: Graph, log: Callable[[str], None]) -> int:
    """relu6(x + 3) / 6 -> HardSigmoid(x, 1/6, 1/2); x * relu6(x + 3) / 6 -> HardSwish(x)."""
    users, n = Users(graph), 0
    for d in list(graph.nodes):
        if d.op not in (M.Div, M.Mul) or d not in graph.nodes:
            continue
        m = match_hard_sixth(users, d)
        if m is None or not users.private(m[3], d.outputs[0]):
            continue
        op, attrs, x, nodes = m
        replace(graph, nodes, op, [x], attrs, d.outputs[0], log)
        users.refresh()
        n += 1
    return n


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


PASSES = [("fuse_hard_sixths", fuse_hard_sixths), ("fuse_activations", fuse_activations)]
