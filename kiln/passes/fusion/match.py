"""Matching helpers shared by the transformer fusions: constants, producers, single readers,
and the one way a matched subgraph is replaced by a fused node (named and logged after the
nodes it merged)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from kiln.ir import Graph, Node, OpDef, Value
from kiln.ir.rewrite import is_graph_output, replace_uses
from kiln.ops import tensor as T


def const_of(v: Value | None) -> np.ndarray | None:
    """The build-time value of ``v``: a weight, a folded value or a Constant node's output."""
    if v is None:
        return None
    if v.const is not None:
        return np.asarray(v.const)
    p = v.producer
    if p is not None and p.op is T.Constant and getattr(p.attrs, "value", None) is not None:
        return np.asarray(p.attrs.value)
    return None


def scalar_of(v: Value | None) -> float | None:
    """The float value of a one-element constant (any rank), else None."""
    c = const_of(v)
    if c is None or c.size != 1 or c.dtype.kind not in "fiu":
        return None
    return float(c.reshape(-1)[0])


def is_scalar(v: Value | None, want: float, rel: float = 1e-4) -> bool:
    s = scalar_of(v)
    return s is not None and abs(s - want) <= rel * max(abs(want), 1e-12)


def made_by(v: Value | None, *ops: OpDef) -> Node | None:
    """The node producing ``v`` when its op is one of ``ops``."""
    p = v.producer if v is not None else None
    return p if p is not None and p.op in ops else None


def split_const(node: Node) -> tuple[Value, float] | None:
    """For a binary node with one scalar-constant input: (the other input, the scalar)."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if scalar_of(b) is not None and const_of(a) is None:
        return a, scalar_of(b)
    if scalar_of(a) is not None and const_of(b) is None:
        return b, scalar_of(a)
    return None


def other(node: Node, v: Value) -> Value | None:
    """The other input of a binary node one of whose inputs is ``v``."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is v else a if b is v else None


class Users:
    """Readers of every value, computed once per scan and refreshed after each rewrite."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.refresh()

    def refresh(self) -> None:
        self.map = self.graph.users()

    def of(self, v: Value) -> list[Node]:
        return self.map.get(id(v), [])

    def only(self, v: Value) -> Node | None:
        """The single node reading ``v`` (None when several read it or it is an output)."""
        us = self.of(v)
        if len(us) != 1 or is_graph_output(self.graph, v):
            return None
        return us[0]

    def private(self, nodes: list[Node], out: Value) -> bool:
        """True when every value made by ``nodes`` other than ``out`` is read only inside
        ``nodes`` (so removing them loses nothing)."""
        inside = {id(n) for n in nodes}
        for n in nodes:
            for o in n.outputs:
                if o is out:
                    continue
                if is_graph_output(self.graph, o):
                    return False
                if any(id(u) not in inside for u in self.of(o)):
                    return False
        return True


def same_dim(a, b) -> bool:
    return a is not None and b is not None and str(a) == str(b)


def shape_of(v: Value | None):
    return getattr(v.type, "shape", None) if v is not None else None


def replace(graph: Graph, nodes: list[Node], op: OpDef, inputs: list, attrs,
            out: Value, log: Callable[[str], None], label: str | None = None) -> Node:
    """Replace ``nodes`` (whose one result is ``out``) by one ``op`` node computing ``out``.

    The fused node takes the place of the last matched node (every input it reads is defined
    before that one) and is named after the merged nodes: ``"a + b + c"``."""
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    nodes = sorted(nodes, key=lambda n: order[id(n)])
    name = " + ".join(n.name for n in nodes)
    new_out = Value(out.name, out.type)
    fused = Node(op, name, inputs, [new_out], attrs)
    graph.nodes.insert(order[id(nodes[-1])], fused)
    replace_uses(graph, out, new_out)
    dead = {id(n) for n in nodes}
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    log(f"fused {name} -> {label or op.qualname}")
    return fused


NOT_FUSED = "not fused: "  # the prefix of a near miss in the log (the builder collects them)


def reject(log: Callable[[str], None], pattern: str, at: Node, why: str) -> None:
    """Log a near miss: ``pattern`` almost matched at node ``at`` but did not, because ``why``
    (TensorRT's verbose log says why a layer was not fused in the same way)."""
    log(f"{NOT_FUSED}{pattern} at node '{at.name}': {why}")


def add_const(graph: Graph, base: str, array: np.ndarray) -> Value:
    """A new weight holding ``array`` (a transformed or merged parameter)."""
    from kiln.ir import DType, TensorType

    array = np.ascontiguousarray(array)
    name = graph.fresh_name(base)
    return graph.add_weight(name, array, TensorType(DType.from_np(array.dtype), array.shape))


def reduce_axes(node: Node, rank: int | None) -> list[int] | None:
    """The sorted, non-negative axes a Reduce* node reduces (attribute or input form), when
    known and keepdims is on; None otherwise."""
    a = node.attrs
    if rank is None or (getattr(a, "keepdims", 1) or 0) != 1:
        return None
    axes = const_of(node.inputs[1]) if len(node.inputs) > 1 else getattr(a, "axes", None)
    if axes is None:
        return None
    axes = [int(x) for x in np.asarray(axes).reshape(-1)]
    return sorted(x + rank if x < 0 else x for x in axes) or None


def trailing(axes: list[int] | None, rank: int | None) -> int | None:
    """The first axis when ``axes`` are the last len(axes) axes of a rank-``rank`` tensor."""
    if not axes or rank is None or axes != list(range(rank - len(axes), rank)):
        return None
    return axes[0]
