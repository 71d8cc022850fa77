"""RMS normalization spelled out in elementwise ops -> one ONNX RMSNormalization.

LLaMA-style exports write RMSNorm as::

    x ──Pow(x, 2) | Mul(x, x)──▶ ReduceMean(last axes) ──Add(eps)──▶ Sqrt ──▶ σ
    x ──Div(x, σ) | Mul(x, Reciprocal(σ)) | Mul(x, Div(1, σ))──▶ n ──Mul(γ)──▶ y
                                                                   (γ constant, optional)

which becomes ``RMSNormalization(x, γ, axis, epsilon)``.
"""

from __future__ import annotations

from typing import Callable

from kiln.ir import Graph, Node
from kiln.ops import nn as N
from kiln.passes.fusion.layernorm import (
    norm_param,
    norm_sites,
    normalized,
    root_mean_square,
)
from kiln.passes.fusion.match import (
    Users,
    add_const,
    reduce_axes,
    replace,
    shape_of,
    trailing,
)


def match_rms(top: Node):
    """Walk up from the normalizing node; returns (x, axis, eps, nodes) or None."""
    got = normalized(top)
    if got is None:
        return None
    x, sigma, extra = got
    stat = root_mean_square(sigma, x)
    if stat is None:
        return None
    eps, mean, chain = stat
    rank = len(shape_of(x)) if shape_of(x) is not None else None
    axis = trailing(reduce_axes(mean, rank), rank)
    if axis is None:
        return None
    return x, axis, eps, [*chain, top, *extra]


def fuse_rmsnorm(graph: Graph, log: Callable[[str], None]) -> int:
    """Decomposed RMSNorm -> RMSNormalization(x, γ)."""
    users, n = Users(graph), 0
    for x, axis, eps, nodes, norm_shape, dt, out, gamma in norm_sites(graph, users, match_rms):
        g = norm_param(gamma, norm_shape, 1.0, dt.np)
        if g is None or not users.private(nodes, out) or \
                len(shape_of(out) or ()) != len(shape_of(x)):
            continue
        attrs = N.RMSNormalization.make_attrs(axis=axis, epsilon=float(eps), stash_type=1)
        replace(graph, nodes, N.RMSNormalization, [x, add_const(graph, "rms_scale", g)], attrs,
                out, log)
        users.refresh()
        n += 1
    return n


PASSES = [("fuse_rmsnorm", fuse_rmsnorm)]
