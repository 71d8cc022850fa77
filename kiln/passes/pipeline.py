"""The optimizer: one ordered list of named passes. Each pass takes a graph and returns the
number of rewrites it made; the verifier checks the graph after every pass."""

from __future__ import annotations

from typing import Callable

from kiln.ir import Graph
from kiln.passes.verifier import verify

PASSES: list[tuple[str, Callable[[Graph], int]]] = []


def optimize(graph: Graph, log: Callable[[str], None] = lambda m: None,
             check: bool = True) -> Graph:
    if check:
        verify(graph)
    for name, fn in PASSES:
        n = fn(graph)
        if n:
            log(f"pass {name}: {n} rewrite(s)")
        if check:
            verify(graph, after=name)
    return graph
