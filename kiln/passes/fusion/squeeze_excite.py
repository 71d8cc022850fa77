"""Fusion: a squeeze-excite block -> one kiln::SqueezeExcite.

MobileNetV3, EfficientNet and their kin scale each channel by a gate computed from the
channel means::

    x ──ReduceMean(H, W) | GlobalAveragePool──▶ s ──Conv 1x1(W1, b1)──▶ act ──Conv 1x1(W2, b2)
      ──▶ Sigmoid | HardSigmoid ──▶ g ──Mul(x, g)──▶ y

``SqueezeExcite(x, W1, b1, W2, b2, activation, gate)`` computes the same thing in one layer: the
two convolutions act on a [N, C] vector, so they are two small matrix products, and the five or
six layers of dispatch become one. ``act`` is any activation ``conv_bias_act`` knows (Relu,
HardSwish, SiLU drawn out, ...) or none. Conditions: x is 4-D, both convs are 1x1 with stride 1,
no padding and one group, with constant weights and biases; every value inside is read by the
next node alone. A Mul by a gate whose chain does not match is logged as a near miss.
"""

from __future__ import annotations

from typing import Callable

from kiln.ir import Graph, Node, Value
from kiln.ops import fused_conv as FC
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import reduce as R
from kiln.passes.fusion.conv_bias_act import match_activation
from kiln.passes.fusion.match import Users, made_by, reduce_axes, reject, replace


def pointwise_conv(n: Node | None) -> str | None:
    """Why ``n`` is not a 1x1, stride 1, unpadded, single-group Conv with constant weights."""
    if n is None or n.op is not N.Conv:
        return "the gate is not computed by a Conv"
    w = n.inputs[1]
    b = n.inputs[2] if len(n.inputs) > 2 else None
    a = n.attrs
    if w is None or w.const is None or w.const.ndim != 4 or w.const.shape[2:] != (1, 1):
        return f"Conv '{n.name}' is not a 1x1 conv with a constant weight"
    if (b is not None and b.const is None) or (a.group or 1) != 1:
        return f"Conv '{n.name}' has a computed bias or groups"
    if any(s != 1 for s in a.strides or ()) or any(p for p in a.pads or ()):
        return f"Conv '{n.name}' has strides or pads"
    return None


def _squeezed(users: Users, s: Value, x: Value) -> Node | None:
    """``s`` = the mean of ``x`` over H and W, kept 4-D: the node computing it."""
    n = made_by(s, R.ReduceMean, N.GlobalAveragePool)
    if n is None or n.inputs[0] is not x or users.only(s) is None:
        return None
    return n if n.op is N.GlobalAveragePool or reduce_axes(n, 4) == [2, 3] else None


def _gate(g: Node):
    if g.op is M.Sigmoid:
        return "Sigmoid", 0.0, 0.0
    a = g.attrs
    return "HardSigmoid", 0.2 if a.alpha is None else a.alpha, 0.5 if a.beta is None else a.beta


def match_se(graph: Graph, users: Users, mul: Node, x: Value, g: Value):
    """(inputs, attrs, nodes) of the SqueezeExcite ending at ``mul`` = x * g, a reason string
    when ``g`` is a gate over a chain that does not match, or None."""
    gate = made_by(g, M.Sigmoid, M.HardSigmoid)
    if gate is None or users.only(g) is not mul or getattr(x.type, "rank", None) != 4:
        return None
    conv2 = made_by(gate.inputs[0], N.Conv)
    if conv2 is None or users.only(gate.inputs[0]) is not gate:
        return None  # a gate on something else, or SiLU (x * Sigmoid(x)): no candidate
    why = pointwise_conv(conv2)
    h, act, act_nodes = conv2.inputs[0], "", []
    conv1 = made_by(h, N.Conv)
    if conv1 is None and h.producer is not None and h.producer.inputs:
        conv1 = made_by(h.producer.inputs[0], N.Conv) or made_by(
            h.producer.inputs[-1], N.Conv)
        m = match_activation(graph, conv1.outputs[0], users.map) if conv1 else None
        if m is None or m[2] is not h or m[0][1] or m[0][2]:
            return why or "the activation between the two convs is not one FusedConv takes"
        act, act_nodes = m[0][0], m[1]
    why = why or pointwise_conv(conv1)
    squeeze = _squeezed(users, conv1.inputs[0], x) if conv1 is not None else None
    if why or squeeze is None:
        return why or "the first conv does not read the mean of x over H and W"
    nodes = [squeeze, conv1, *act_nodes, conv2, gate, mul]
    if not users.private(nodes, mul.outputs[0]):
        return "a value inside the block is read outside it"
    opt = [c.inputs[2] if len(c.inputs) > 2 else None for c in (conv1, conv2)]
    name, alpha, beta = _gate(gate)
    attrs = FC.SqueezeExcite.make_attrs(activation=act, gate=name, alpha=alpha, beta=beta)
    return [x, conv1.inputs[1], opt[0], conv2.inputs[1], opt[1]], attrs, nodes


def fuse_squeeze_excite(graph: Graph, log: Callable[[str], None]) -> int:
    """x * gate(Conv(act(Conv(mean(x))))) -> SqueezeExcite(x, W1, b1, W2, b2)."""
    users, n = Users(graph), 0
    for mul in list(graph.nodes):
        if mul.op is not M.Mul or mul not in graph.nodes or len(mul.inputs) != 2:
            continue
        for x, g in (mul.inputs, mul.inputs[::-1]):
            m = match_se(graph, users, mul, x, g)
            if isinstance(m, str):
                reject(log, "squeeze-excite", mul, m)
            if m is None or isinstance(m, str):
                continue
            ins, attrs, nodes = m
            replace(graph, nodes, FC.SqueezeExcite, ins, attrs, mul.outputs[0], log)
            users.refresh()
            n += 1
            break
    return n


PASSES = [("fuse_squeeze_excite", fuse_squeeze_excite)]
