"""Fusion: a convolution or matrix product with its bias, residual add and activation.

    x   W                                     x   W  b  r
    │   │                                     │   │  │  │
    Conv ─ Add(b) ─ Add(r) ─ Relu     ==>     FusedConv(activation=Relu, has_residual=1)
    (or Gemm / FusedMatMul / MatMul)          "conv + add + add_1 + relu"
                                              (FusedGemm / FusedMatMul)

Every step after the product is optional, but at least one must be there:

- bias: ``Add(y, b)`` with ``b`` a per-output-channel constant, only for a Conv without bias
  (MatMul biases are matmul_add's work);
- residual: ``Add(y, r)`` with ``r`` computed (not constant) and of exactly ``y``'s shape, so
  the add needs no broadcast;
- activation: one of :data:`pm_activation` (Relu, Clip with constant bounds, Sigmoid, Tanh,
  HardSwish, LeakyRelu, Gelu) or SiLU drawn as ``Mul(y, Sigmoid(y))`` or ``Swish(alpha=1)``.

Each merged value must be read by the next step alone and be no graph output. The fused op
computes ``act(op(x, W) + b + r)``, so the activation must come after the residual add.
"""

from __future__ import annotations

import numpy as np
import sympy

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.rewrite import insert_before, is_graph_output, remove_nodes, single_user
from kiln.ops import fused_conv as FC
from kiln.ops import math as M
from kiln.ops import nn as N

_F32_MAX = 3.4028234663852886e38


def _clip_bounds(n: Node):
    """(min, max) of a Clip with constant bounds (inputs from opset 11, attributes before)."""
    if len(n.inputs) == 1:
        return float(n.attrs.min), float(n.attrs.max)
    bounds = []
    for i, default in ((1, -_F32_MAX), (2, _F32_MAX)):
        v = n.inputs[i] if i < len(n.inputs) else None
        if v is not None and (v.const is None or v.const.size != 1):
            return None
        bounds.append(default if v is None else float(v.const.reshape(())))
    return tuple(bounds)


def _clip(n: Node):
    b = _clip_bounds(n)
    return None if b is None else ("Clip", b[0], b[1])


# activation op -> (activation, alpha, beta) of the fused op, or None when it cannot fuse
pm_activation = {
    M.Relu: lambda n: ("Relu", 0.0, 0.0),             # Relu(y) -> max(y, 0)
    M.Clip: _clip,                                    # Clip(y, lo, hi) -> alpha=lo, beta=hi
    M.Sigmoid: lambda n: ("Sigmoid", 0.0, 0.0),       # 1 / (1 + exp(-y))
    M.Tanh: lambda n: ("Tanh", 0.0, 0.0),
    M.HardSwish: lambda n: ("HardSwish", 0.0, 0.0),   # y * relu6(y + 3) / 6
    M.LeakyRelu: lambda n: ("LeakyRelu", float(n.attrs.alpha), 0.0),  # y<0: alpha*y
    M.Gelu: lambda n: ({"none": ("Gelu", 0.0, 0.0), "tanh": ("GeluTanh", 0.0, 0.0)}
                       .get(n.attrs.approximate or "none")),
    M.Swish: lambda n: ("Silu", 0.0, 0.0) if n.attrs.alpha in (None, 1.0) else None,
}


def _match_silu(graph: Graph, v: Value, users: dict):
    """``Mul(y, Sigmoid(y))`` -> ([sigmoid, mul], out); y is read by exactly these two."""
    us = users.get(id(v), [])
    if len(us) != 2 or is_graph_output(graph, v):
        return None
    sig = next((u for u in us if u.op is M.Sigmoid), None)
    mul = next((u for u in us if u.op is M.Mul), None)
    if sig is None or mul is None or single_user(graph, sig.outputs[0], users) is not mul:
        return None
    if {id(x) for x in mul.inputs} != {id(v), id(sig.outputs[0])}:
        return None
    return [sig, mul], mul.outputs[0]


def match_activation(graph: Graph, v: Value, users: dict):
    """The activation reading ``v``: ((activation, alpha, beta), nodes, out) or None."""
    silu = _match_silu(graph, v, users)
    if silu is not None:
        return ("Silu", 0.0, 0.0), *silu
    u = single_user(graph, v, users)
    rule = pm_activation.get(u.op) if u is not None else None
    act = rule(u) if rule is not None and u.inputs[0] is v else None
    return None if act is None else (act, [u], u.outputs[0])


def _same_shape(a: Value, b: Value) -> bool:
    sa, sb = getattr(a.type, "shape", None), getattr(b.type, "shape", None)
    if sa is None or sb is None or len(sa) != len(sb) or a.type.dtype != b.type.dtype:
        return False
    return all(x is not None and y is not None and sympy.simplify(x - y) == 0
               for x, y in zip(sa, sb))


def _add_other(graph: Graph, v: Value, users: dict):
    """The single Add reading ``v`` and its other operand, or (None, None)."""
    u = single_user(graph, v, users)
    if u is None or u.op is not M.Add or len(u.inputs) != 2:
        return None, None
    other = u.inputs[1] if u.inputs[0] is v else u.inputs[0]
    return (u, other) if other is not v else (None, None)


def _channel_bias(conv: Node, c: Value) -> np.ndarray | None:
    """``c`` as a [M] bias when it broadcasts to [1, M, 1, ...] over the conv output."""
    out = conv.outputs[0].type
    w = conv.inputs[1]
    if c.const is None or out is None or out.shape is None or w.type is None:
        return None
    rank, m = len(out.shape), w.type.shape[0] if w.type.shape else None
    if c.type is None or c.type.dtype != out.dtype or c.const.ndim > rank:
        return None
    shape = (1,) * (rank - c.const.ndim) + tuple(c.const.shape)
    if not isinstance(m, int) or shape[1] != m or any(d != 1 for i, d in enumerate(shape)
                                                        if i != 1):
        return None
    return c.const.reshape(m)


def _product_op(n: Node):
    """The fused op an anchor node becomes, or None when it cannot anchor a fusion."""
    w = n.inputs[1] if len(n.inputs) > 1 else None
    if w is None or w.const is None:
        return None  # a computed weight: kernels pre-pack weights once
    if n.op is N.Conv:
        return FC.FusedConv
    if n.op is N.Gemm and n.attrs.alpha == 1.0 and (
            n.attrs.beta == 1.0 or len(n.inputs) < 3 or n.inputs[2] is None):
        return FC.FusedGemm
    if n.op is FC.FusedMatMul and not n.attrs.activation and not n.attrs.has_residual:
        return FC.FusedMatMul
    if n.op is N.MatMul and w.const.ndim == 2:
        return FC.FusedMatMul
    return None


def _match_chain(graph: Graph, anchor: Node, users: dict):
    """Nodes merged after ``anchor``: (nodes, bias array, residual, (act, alpha, beta), out)."""
    nodes, v, bias, residual, act = [anchor], anchor.outputs[0], None, None, ("", 0.0, 0.0)
    if anchor.op is N.Conv and (len(anchor.inputs) < 3 or anchor.inputs[2] is None):
        add, c = _add_other(graph, v, users)
        if add is not None and (bias := _channel_bias(anchor, c)) is not None:
            nodes, v = nodes + [add], add.outputs[0]  # Conv(x, W) + b -> Conv(x, W, b)
    add, r = _add_other(graph, v, users)
    if add is not None and r.const is None and _same_shape(r, v):
        nodes, v, residual = nodes + [add], add.outputs[0], r  # y + r, no broadcast
    m = match_activation(graph, v, users)
    if m is not None:
        act, more, v = m
        nodes = nodes + more
    return None if len(nodes) == 1 else (nodes, bias, residual, act, v)


def _fused_inputs(graph: Graph, anchor: Node, bias, residual) -> list:
    ins = list(anchor.inputs[:3]) + [None] * (3 - len(anchor.inputs[:3]))
    if bias is not None:
        w = anchor.inputs[1]
        ins[2] = graph.add_weight(graph.fresh_name(f"{w.name}_bias"), bias,
                                  TensorType(w.type.dtype, bias.shape))
    ins.append(residual)
    while ins and ins[-1] is None:
        ins.pop()
    return ins


def _fused_attrs(op, anchor: Node, act, has_residual: bool):
    kw = {"activation": act[0], "alpha": act[1], "beta": act[2],
          "has_residual": int(has_residual)}
    a = anchor.attrs
    if op is FC.FusedConv:
        kw.update(auto_pad=a.auto_pad or "NOTSET", dilations=a.dilations, group=a.group or 1,
                  kernel_shape=a.kernel_shape, pads=a.pads, strides=a.strides)
    elif op is FC.FusedGemm:
        kw.update(transA=a.transA or 0, transB=a.transB or 0)
    return op.make_attrs(**kw)


def _drop_bias_weight(graph: Graph, nodes: list[Node], bias, users: dict) -> None:
    """Forget the weight a merged bias Add read, when nothing else reads it."""
    if bias is None:
        return
    add = nodes[1]
    old = add.inputs[1] if add.inputs[0] is nodes[0].outputs[0] else add.inputs[0]
    if len(users.get(id(old), ())) == 1 and graph.weights.get(old.name) is old:
        del graph.weights[old.name]


def fuse_conv_bias_act(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    # last anchor first: a residual add then joins the product computed last (as in ORT)
    for anchor in reversed(list(graph.nodes)):
        op = _product_op(anchor)
        m = _match_chain(graph, anchor, users) if op is not None else None
        if m is None:
            continue
        nodes, bias, residual, act, out = m
        fused = Node(op, " + ".join(x.name for x in nodes),
                     _fused_inputs(graph, anchor, bias, residual), [out],
                     _fused_attrs(op, anchor, act, residual is not None))
        insert_before(graph, nodes[-1], fused)
        remove_nodes(graph, nodes)
        _drop_bias_weight(graph, nodes, bias, users)
        users = graph.users()  # the merged nodes are gone: later matches must not see them
        log(f"fused {fused.name} -> {op.name}")
        n += 1
    return n


PASSES = [("fuse_conv_bias_act", fuse_conv_bias_act)]
