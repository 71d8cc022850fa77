"""A readable text form of a graph, one node per line:

    graph main(%x: float32[batch,8]) -> (%y)
      weights: %w1 float32[8,16], %b1 float32[16]
      %h: float32[batch,16] = MatMul(%x, %w1)                    # fc1
      %y: float32[batch,4] = Relu(%h)                            # relu1
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kiln.ir.graph import Graph, Node, Value


def format_graph(g: Graph, indent: str = "") -> str:
    ins = ", ".join(f"%{v.name}: {v.type}" for v in g.inputs + g.captures)
    outs = ", ".join(f"%{v.name}" for v in g.outputs)
    lines = [f"{indent}graph {g.name}({ins}) -> ({outs})"]
    if g.weights:
        ws = ", ".join(f"%{w.name} {w.type}" for w in g.weights.values())
        lines.append(f"{indent}  weights: {ws}")
    for n in g.nodes:
        lines.append(indent + "  " + format_node(n))
        for sg in n.subgraphs():
            lines.append(format_graph(sg, indent + "    "))
    return "\n".join(lines)


def format_node(n: Node) -> str:
    outs = ", ".join(f"%{v.name}: {v.type}" for v in n.outputs)
    args = ", ".join(_arg(v) for v in n.inputs)
    attrs = _attrs(n)
    op = n.op.qualname
    text = f"{outs} = {op}{'[' + attrs + ']' if attrs else ''}({args})"
    return f"{text:<70} # {n.name}"


def _arg(v: Value | None) -> str:
    if v is None:
        return "_"
    if v.const is not None and v.producer is None and v.const.size <= 4:
        return np.array2string(np.asarray(v.const), separator=",")
    return f"%{v.name}"


def _attrs(n: Node) -> str:
    parts = []
    for f in dataclasses.fields(n.attrs):
        val = getattr(n.attrs, f.name)
        if val is None or isinstance(val, Graph) or (isinstance(val, tuple) and val and
                                                     isinstance(val[0], Graph)):
            continue
        spec = n.op.attrs.get(f.name)
        if spec is not None and spec.default is val:
            continue
        if isinstance(val, np.ndarray):
            val = f"tensor{list(val.shape)}"
        parts.append(f"{f.name}={val}")
    return ", ".join(parts)
