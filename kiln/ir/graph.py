"""The graph IR: Values connect Nodes; weights are Values with a constant, kept out of the nodes."""

from __future__ import annotations

import itertools
from typing import Iterable

import numpy as np

from kiln.ir.opdef import OpDef
from kiln.ir.types import Type


class Value:
    __slots__ = ("name", "type", "producer", "const", "sym")

    def __init__(self, name: str, type: Type = None, const: np.ndarray | None = None):
        self.name = name
        self.type = type
        self.producer: Node | None = None
        self.const = const  # weights and folded constants
        self.sym: tuple | None = None  # symbolic contents of a small int vector

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    __slots__ = ("op", "name", "inputs", "outputs", "attrs")

    def __init__(self, op: OpDef, name: str, inputs: list, outputs: list[Value], attrs=None):
        self.op = op
        self.name = name
        self.inputs: list[Value | None] = list(inputs)  # None for an omitted optional input
        self.outputs: list[Value] = list(outputs)
        self.attrs = attrs if attrs is not None else op.Attrs()
        for o in self.outputs:
            o.producer = self

    def subgraphs(self) -> list[Graph]:
        gs = []
        for v in vars(self.attrs).values():
            if isinstance(v, Graph):
                gs.append(v)
            elif isinstance(v, tuple) and v and isinstance(v[0], Graph):
                gs.extend(v)
        return gs

    def __repr__(self) -> str:
        return f"Node({self.op.name} {self.name!r})"


class Graph:
    """A graph. ``captures`` are values of an enclosing graph that a subgraph reads; the node
    that owns the subgraph lists them as extra trailing inputs, so every dependency is explicit."""

    def __init__(self, name: str = "main"):
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.weights: dict[str, Value] = {}
        self.captures: list[Value] = []
        self.opset: dict[str, int] = {}
        self.metadata: dict[str, str] = {}
        self._names = itertools.count()

    def add_weight(self, name: str, array: np.ndarray, type: Type) -> Value:
        v = Value(name, type, const=array)
        self.weights[name] = v
        return v

    def add_node(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def fresh_name(self, base: str) -> str:
        return f"{base}__{next(self._names)}"

    def values(self) -> Iterable[Value]:
        seen = set()
        for v in itertools.chain(self.inputs, self.weights.values(), self.captures):
            if id(v) not in seen:
                seen.add(id(v))
                yield v
        for n in self.nodes:
            for v in n.outputs:
                yield v

    def users(self) -> dict[int, list[Node]]:
        """id(value) -> nodes that read it (subgraph captures count as reads by the owner)."""
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    out.setdefault(id(v), []).append(n)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op.name] = counts.get(n.op.name, 0) + 1
        return dict(sorted(counts.items()))
