"""The graph verifier: run after every pass (always in tests). Raises on the first problem."""

from __future__ import annotations

from kiln.ir import REGISTRY, Graph


class VerifyError(AssertionError):
    pass


def verify(graph: Graph, after: str = "import") -> None:
    _verify(graph, after, outer=set())


def _verify(graph: Graph, after: str, outer: set[int]) -> None:
    where = f"after {after}: graph '{graph.name}'"
    defined = {id(v) for v in graph.inputs} | {id(v) for v in graph.weights.values()}
    defined |= {id(v) for v in graph.captures}
    names: set[str] = set()
    for n in graph.nodes:
        if REGISTRY.get(n.op.domain, n.op.name) is not n.op:
            raise VerifyError(f"{where}: node '{n.name}' has unregistered op {n.op.qualname}")
        if not isinstance(n.attrs, n.op.Attrs):
            raise VerifyError(f"{where}: node '{n.name}' attrs are not {n.op.name}'s")
        if n.name in names:
            raise VerifyError(f"{where}: node name '{n.name}' is used twice")
        names.add(n.name)
        for v in n.inputs:
            if v is not None and id(v) not in defined and v.const is None:
                raise VerifyError(f"{where}: node '{n.name}' reads '{v.name}' before it is "
                                  "defined")
        for v in n.outputs:
            if id(v) in defined:
                raise VerifyError(f"{where}: value '{v.name}' is defined twice")
            if v.producer is not n:
                raise VerifyError(f"{where}: value '{v.name}' does not point to its producer")
            defined.add(id(v))
        for g in n.subgraphs():
            _verify(g, after, defined | outer)
    for v in graph.outputs:
        if id(v) not in defined and v.const is None:
            raise VerifyError(f"{where}: output '{v.name}' is never defined")
