"""GELU spelled out in elementwise ops -> one ONNX Gelu.

The exact form (BERT), as exporters write it (the three Muls in any order)::

    x ──Div(√2) | Mul(1/√2)──▶ Erf ──Add(1)──▶ a ──Mul(x)──▶ Mul(0.5)──▶ y
                                                 (or x*0.5 first, or a*0.5 first)

and the tanh form (GPT-2)::

    x ──Mul(x)──Mul(x)──▶ x³ ──Mul(0.044715)──Add(x)──Mul(√(2/π))──▶ Tanh ──Add(1)──▶ a
    a ──(times x and 0.5, in any order)──▶ y        (x³ also as Pow(x, 3))

and the tanh form with the cube factored (Hugging Face's ``gelu_fast``)::

    x ──Mul(√(2/π))──▶ a,  x ──Mul(0.044715)──Mul(x)──Add(1)──▶ b   (0.044715 x² + 1)
    Tanh(a * b) ──Add(1)── (times x and 0.5)──▶ y

become ``Gelu(x, approximate="none" | "tanh")``: one kernel instead of five or eight.
"""

from __future__ import annotations

import math
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

SQRT2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def erf_input(erf: Node) -> tuple[Value, list[Node]] | None:
    """Erf(x / √2) or Erf(x * (1/√2)) -> x."""
    n = made_by(erf.inputs[0], M.Div, M.Mul)
    if n is None:
        return None
    if n.op is M.Div and is_scalar(n.inputs[1], SQRT2):  # x / √2
        return n.inputs[0], [n]
    got = split_const(n) if n.op is M.Mul else None
    if got and abs(got[1] - 1 / SQRT2) < 1e-4:  # x * (1/√2)
        return got[0], [n]
    return None


def _is_cube_of(v: Value, x: Value) -> list[Node] | None:
    """Pow(x, 3), Mul(x, Mul(x, x)) or Mul(Mul(x, x), x) -> the nodes."""
    n = made_by(v, M.Pow, M.Mul)
    if n is None:
        return None
    if n.op is M.Pow:
        return [n] if n.inputs[0] is x and scalar_of(n.inputs[1]) == 3.0 else None
    sq_in = other(n, x)
    sq = made_by(sq_in, M.Mul) if sq_in is not None else None
    if sq is not None and sq.inputs[0] is x and sq.inputs[1] is x:
        return [sq, n]
    return None


def tanh_input(tanh: Node) -> tuple[Value, list[Node]] | None:
    """Tanh(√(2/π) * (x + 0.044715 * x³)) -> x."""
    scale = made_by(tanh.inputs[0], M.Mul)
    got = split_const(scale) if scale else None
    if got is None or abs(got[1] - SQRT_2_OVER_PI) > 1e-4:
        return None
    add = made_by(got[0], M.Add)
    if add is None:
        return None
    for x, k in (add.inputs, add.inputs[::-1]):
        kn = made_by(k, M.Mul)
        kc = split_const(kn) if kn else None
        if kc is None or abs(kc[1] - 0.044715) > 1e-6:
            continue
        cube = _is_cube_of(kc[0], x)
        if cube is not None:
            return x, [*cube, kn, add, scale]
    return None


def _scaled_square(v: Value, x: Value, c: float) -> list[Node] | None:
    """``v`` = c * x * x in any association (Mul(Mul(x, c), x), Mul(Mul(x, x), c), ...)."""
    outer = made_by(v, M.Mul)
    if outer is None:
        return None
    got = split_const(outer)
    if got is not None and abs(got[1] - c) < 1e-6:  # Mul(x², c)
        sq = made_by(got[0], M.Mul)
        ok = sq is not None and sq.inputs[0] is x and sq.inputs[1] is x
        return [sq, outer] if ok else None
    inner_in = other(outer, x)
    inner = made_by(inner_in, M.Mul) if inner_in is not None else None
    got = split_const(inner) if inner is not None else None
    if got is not None and got[0] is x and abs(got[1] - c) < 1e-6:  # Mul(Mul(x, c), x)
        return [inner, outer]
    return None


def fast_tanh_input(tanh: Node) -> tuple[Value, list[Node]] | None:
    """Tanh((x * √(2/π)) * (1 + 0.044715 * x * x)) -> x."""
    m = made_by(tanh.inputs[0], M.Mul)
    if m is None:
        return None
    for a, b in (m.inputs, m.inputs[::-1]):
        an, bn = made_by(a, M.Mul), made_by(b, M.Add)
        got = split_const(an) if an is not None else None
        one = split_const(bn) if bn is not None else None
        if got is None or one is None or abs(got[1] - SQRT_2_OVER_PI) > 1e-4 or one[1] != 1.0:
            continue
        sq = _scaled_square(one[0], got[0], 0.044715)
        if sq is not None:
            return got[0], [an, *sq, bn, m]
    return None


def _factor(users: Users, v: Value, x: Value) -> tuple[list, list[Node]] | None:
    """What one Mul operand contributes: x, a scalar, or a private Mul(x, scalar)."""
    if v is x:
        return ["x"], []
    s = scalar_of(v)
    if s is not None:
        return [s], []
    n = made_by(v, M.Mul)
    got = split_const(n) if n is not None and users.only(v) is not None else None
    if got is not None and got[0] is x:
        return ["x", got[1]], [n]
    return None


def times_half_x(users: Users, a: Value, x: Value) -> tuple[Value, list[Node]] | None:
    """Follow up to two Muls from ``a`` until the product is a * x * 0.5."""
    cur, nodes, factors = a, [], []
    for _ in range(2):
        m = users.only(cur)
        if m is None or m.op is not M.Mul:
            return None
        f = _factor(users, other(m, cur), x)
        if f is None:
            return None
        factors += f[0]
        nodes += [*f[1], m]
        cur = m.outputs[0]
        scalars = [s for s in factors if s != "x"]
        if factors.count("x") == 1 and len(scalars) == 1 and abs(scalars[0] - 0.5) < 1e-6:
            return cur, nodes
    return None


def plus_one(users: Users, v: Value) -> Node | None:
    """The single reader of ``v`` when it is Add(v, 1)."""
    add = users.only(v)
    if add is None or add.op is not M.Add:
        return None
    return add if is_scalar(other(add, v), 1.0) else None


def fuse_gelu(graph: Graph, log: Callable[[str], None]) -> int:
    """Erf-form and tanh-form GELU -> Gelu(x)."""
    users, n = Users(graph), 0
    for core in list(graph.nodes):
        if core.op not in (M.Erf, M.Tanh) or core not in graph.nodes:
            continue
        got = erf_input(core) if core.op is M.Erf else (tanh_input(core) or
                                                         fast_tanh_input(core))
        one = plus_one(users, core.outputs[0]) if got else None
        tail = times_half_x(users, one.outputs[0], got[0]) if one else None
        if tail is None:
            continue
        x, out = got[0], tail[0]
        nodes = [*got[1], core, one, *tail[1]]
        if not users.private(nodes, out):
            continue
        approx = "none" if core.op is M.Erf else "tanh"
        replace(graph, nodes, M.Gelu, [x], M.Gelu.make_attrs(approximate=approx), out, log)
        users.refresh()
        n += 1
    return n


PASSES = [("fuse_gelu", fuse_gelu)]
