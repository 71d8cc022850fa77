"""Fusion: a matrix product by a constant weight and the bias added after it.

    x [.., M, K]   W [K, N] (constant)          x [M, K]      x [.., M, K]
         │         │                             │              │
         MatMul ───┘                 ==>        Gemm(W, b)  or  FusedMatMul(W, b)   "mm + add"
           │                                  (2-D x)        (N-D x)
          Add(b)   b constant, broadcast on the last dim only: [N], [1, N], [1, 1, N] ...
           │
           y

Fires only when the MatMul output feeds the Add alone (and is no graph output), W is a 2-D
constant, x's rank is known and at least 2, the bias has as many dims as the output at most, and
the dtypes agree. ``b`` is stored as [N] so the kernel can hand it to ``F.linear``.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.rewrite import insert_before, remove_nodes, single_user
from kiln.ops import fused_conv as FC
from kiln.ops import math as M
from kiln.ops import nn as N


def _last_dim_bias(b: Value, w: np.ndarray, out_rank: int, dtype) -> np.ndarray | None:
    """``b`` as an [N] vector when it broadcasts along the output's last dim only."""
    c = b.const
    if c is None or c.ndim == 0 or c.ndim > out_rank or c.dtype != w.dtype:
        return None
    if b.type is None or b.type.dtype != dtype:
        return None
    if c.shape[-1] != w.shape[1] or any(d != 1 for d in c.shape[:-1]):
        return None
    return c.reshape(w.shape[1])


def _match(graph: Graph, mm: Node, users: dict):
    """(add, bias [N]) for a MatMul(x, W) followed by Add(bias), or None."""
    if len(mm.inputs) != 2 or mm.inputs[1] is None:
        return None
    x, w = mm.inputs
    x_shape = getattr(x.type, "shape", None)
    if w.const is None or w.const.ndim != 2 or x_shape is None or len(x_shape) < 2:
        return None
    add = single_user(graph, mm.outputs[0], users)
    if add is None or add.op is not M.Add or len(add.inputs) != 2:
        return None
    b = add.inputs[1] if add.inputs[0] is mm.outputs[0] else add.inputs[0]
    if b is mm.outputs[0]:
        return None
    bias = _last_dim_bias(b, w.const, len(x_shape), x.type.dtype)
    return None if bias is None else (add, bias)


def fuse_matmul_add(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for mm in [x for x in graph.nodes if x.op is N.MatMul]:
        m = _match(graph, mm, users)
        if m is None:
            continue
        add, bias = m
        x, w = mm.inputs
        b = graph.add_weight(graph.fresh_name(f"{add.name}_bias"), bias,
                             TensorType(w.type.dtype, bias.shape))
        if len(x.type.shape) == 2:  # MatMul(x, W) + b -> Gemm(x, W, b)
            op, attrs = N.Gemm, N.Gemm.make_attrs(alpha=1.0, beta=1.0, transA=0, transB=0)
        else:  # MatMul(x, W) + b -> FusedMatMul(x, W, b)
            op, attrs = FC.FusedMatMul, FC.FusedMatMul.make_attrs()
        fused = Node(op, f"{mm.name} + {add.name}", [x, w, b], [add.outputs[0]], attrs)
        insert_before(graph, add, fused)
        remove_nodes(graph, [mm, add])
        old = add.inputs[1] if add.inputs[0] is mm.outputs[0] else add.inputs[0]
        if len(users.get(id(old), ())) == 1 and graph.weights.get(old.name) is old:
            del graph.weights[old.name]  # the bias now lives reshaped in the fused node
        log(f"fused {mm.name} + {add.name} -> {op.name}")
        n += 1
    return n


PASSES = [("fuse_matmul_add", fuse_matmul_add)]
