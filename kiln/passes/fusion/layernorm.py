"""Layer normalization spelled out in elementwise ops -> one ONNX LayerNormalization.

Exporters before opset 17 (and TensorFlow converters) write LayerNorm as::

    x ──ReduceMean(last axes)──▶ μ
    x ──────────────────────────Sub(x, μ)──▶ d ──Pow(d, 2) | Mul(d, d)──▶ ReduceMean ──▶ var
                                             │   var ──Add(eps)──▶ Sqrt ──▶ σ
                                             └──Div(d, σ) | Mul(d, Reciprocal(σ))──▶ n
    n ──Mul(γ)──▶ Add(β)──▶ y          (γ and β constant, each optional)

which becomes ``LayerNormalization(x, γ, β, axis, epsilon)``: one pass over x instead of
nine kernels and four temporaries.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir import Graph, Node
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import reduce as R
from kiln.passes.fusion.match import (
    Users,
    add_const,
    const_of,
    made_by,
    reduce_axes,
    replace,
    scalar_of,
    shape_of,
    split_const,
    trailing,
)


def normalized(node: Node):
    """Div(d, σ), Mul(d, Reciprocal(σ)) or Mul(d, Div(1, σ)) (transformers' LlamaRMSNorm as
    torch.onnx writes rsqrt) -> (d, σ)."""
    if node.op is M.Div:
        return node.inputs[0], node.inputs[1], []
    if node.op is M.Mul:
        for d, r in (node.inputs, node.inputs[::-1]):
            rec = made_by(r, M.Reciprocal)
            if rec is not None:
                return d, rec.inputs[0], [rec]
            div = made_by(r, M.Div)
            if div is not None and scalar_of(div.inputs[0]) == 1.0:
                return d, div.inputs[1], [div]
    return None


def is_square_of(node: Node | None, d) -> bool:
    if node is None:
        return False
    if node.op is M.Pow:  # Pow(d, 2) -> d²
        return node.inputs[0] is d and scalar_of(node.inputs[1]) == 2.0
    return node.op is M.Mul and node.inputs[0] is d and node.inputs[1] is d  # Mul(d, d) -> d²


def root_mean_square(sigma, d):
    """``sigma = Sqrt(ReduceMean(d²) + eps)``: (eps, the ReduceMean, its nodes [d², ReduceMean,
    Add, Sqrt]), or None. The statistic of both LayerNorm (d = x - mean) and RMSNorm (d = x)."""
    sqrt = made_by(sigma, M.Sqrt)
    add = made_by(sqrt.inputs[0], M.Add) if sqrt else None
    ms_eps = split_const(add) if add else None
    mean = made_by(ms_eps[0], R.ReduceMean) if ms_eps else None
    sq = made_by(mean.inputs[0], M.Pow, M.Mul) if mean else None
    if not is_square_of(sq, d):
        return None
    return ms_eps[1], mean, [sq, mean, add, sqrt]


def match_moments(top: Node):
    """Walk up from the normalizing node; returns (x, axis, eps, nodes) or None."""
    got = normalized(top)
    if got is None:
        return None
    d, sigma, extra = got
    stat = root_mean_square(sigma, d)
    sub = made_by(d, M.Sub)
    if stat is None or sub is None:
        return None
    eps, r2, chain = stat
    x = sub.inputs[0]
    r1 = made_by(sub.inputs[1], R.ReduceMean)
    rank = len(shape_of(x)) if shape_of(x) is not None else None
    if r1 is None or r1.inputs[0] is not x:
        return None
    axes = reduce_axes(r1, rank)
    if axes is None or axes != reduce_axes(r2, rank) or trailing(axes, rank) is None:
        return None
    return x, trailing(axes, rank), eps, [r1, sub, *chain, top, *extra]


def affine_tail(users: Users, out, want_op) -> tuple[Node, np.ndarray] | None:
    """The single reader of ``out`` when it is ``want_op(out, constant)``."""
    u = users.only(out)
    if u is None or u.op is not want_op or len(u.inputs) != 2:
        return None
    c = const_of(u.inputs[1] if u.inputs[0] is out else u.inputs[0])
    return (u, c) if c is not None else None


def norm_param(c: np.ndarray | None, norm_shape, fill: float, dtype) -> np.ndarray | None:
    """γ or β broadcast to the normalized shape (None when it does not broadcast there)."""
    if c is None:
        return np.full(norm_shape, fill, dtype)
    lead = c.ndim - len(norm_shape)
    if lead > 0:  # leading 1s only: more would change the output's shape
        if any(s != 1 for s in c.shape[:lead]):
            return None
        c = c.reshape(c.shape[lead:])
    try:
        return np.broadcast_to(c, norm_shape).astype(dtype)
    except ValueError:
        return None


def norm_sites(graph: Graph, users: Users, match):
    """Each decomposed normalization ``match(top)`` finds, ending at a Div/Mul ``top``, with its
    γ multiply absorbed: (x, axis, eps, nodes, norm shape, dtype, out, γ or None). Sites whose
    input is not float or whose normalized dims are not static are skipped. The caller rewrites
    the graph (and refreshes ``users``) between sites."""
    for top in list(graph.nodes):
        if top.op not in (M.Div, M.Mul) or top not in graph.nodes:
            continue
        m = match(top)
        if m is None:
            continue
        x, axis, eps, nodes = m
        shape, dt = shape_of(x), getattr(x.type, "dtype", None)
        norm_shape = tuple(shape[axis:])
        if dt is None or not dt.is_float or not all(isinstance(s, int) for s in norm_shape):
            continue
        out, gamma = top.outputs[0], None
        mul = affine_tail(users, out, M.Mul)
        if mul:  # n * γ
            nodes, out, gamma = nodes + [mul[0]], mul[0].outputs[0], mul[1]
        yield x, axis, eps, nodes, norm_shape, dt, out, gamma


def fuse_layernorm(graph: Graph, log: Callable[[str], None]) -> int:
    """Decomposed LayerNorm -> LayerNormalization(x, γ, β)."""
    users, n = Users(graph), 0
    for x, axis, eps, nodes, norm_shape, dt, out, gamma in norm_sites(graph, users,
                                                                      match_moments):
        beta = None
        add = affine_tail(users, out, M.Add)
        if add:  # (n * γ) + β
            nodes, out, beta = nodes + [add[0]], add[0].outputs[0], add[1]
        g = norm_param(gamma, norm_shape, 1.0, dt.np)
        b = norm_param(beta, norm_shape, 0.0, dt.np) if beta is not None else None
        if g is None or (beta is not None and b is None) or not users.private(nodes, out) \
                or len(shape_of(out) or ()) != len(shape_of(x)):
            continue
        ins = [x, add_const(graph, "ln_scale", g)]
        if b is not None:
            ins.append(add_const(graph, "ln_bias", b))
        attrs = N.LayerNormalization.make_attrs(axis=axis, epsilon=float(eps), stash_type=1)
        replace(graph, nodes, N.LayerNormalization, ins, attrs, out, log)
        users.refresh()
        n += 1
    return n


PASSES = [("fuse_layernorm", fuse_layernorm)]
