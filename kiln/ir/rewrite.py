"""Graph surgery shared by the passes: replacing uses, removing and inserting nodes."""

from __future__ import annotations

from kiln.ir.graph import Graph, Node, Value


def replace_uses(graph: Graph, old: Value, new: Value) -> int:
    """Point every reader of ``old`` (nodes, graph outputs, subgraph captures' owners) at
    ``new``. Returns how many references changed."""
    n = 0
    for node in graph.nodes:
        for i, v in enumerate(node.inputs):
            if v is old:
                node.inputs[i] = new
                n += 1
    for i, v in enumerate(graph.outputs):
        if v is old:
            graph.outputs[i] = new
            n += 1
    return n


def remove_nodes(graph: Graph, dead: set[int] | list[Node]) -> None:
    ids = {id(n) for n in dead} if not isinstance(dead, set) else dead
    graph.nodes = [n for n in graph.nodes if id(n) not in ids]


def insert_before(graph: Graph, anchor: Node, node: Node) -> Node:
    graph.nodes.insert(graph.nodes.index(anchor), node)
    return node


def users_of(graph: Graph) -> dict[int, list[Node]]:
    return graph.users()


def is_graph_output(graph: Graph, v: Value) -> bool:
    return any(o is v for o in graph.outputs)


def single_user(graph: Graph, v: Value, users: dict[int, list[Node]]) -> Node | None:
    """The only node reading ``v``, or None if it has several readers or is a graph output."""
    us = users.get(id(v), [])
    if len(us) != 1 or is_graph_output(graph, v):
        return None
    return us[0]


def toposort(graph: Graph) -> None:
    """Reorder nodes so every node comes after the producers of its inputs (stable)."""
    produced = {id(o): n for n in graph.nodes for o in n.outputs}
    done: set[int] = set()
    order: list[Node] = []

    def visit(n: Node, stack: set[int]):
        if id(n) in done:
            return
        stack.add(id(n))
        for v in n.inputs:
            p = produced.get(id(v)) if v is not None else None
            if p is not None and id(p) not in done and id(p) not in stack:
                visit(p, stack)
        done.add(id(n))
        order.append(n)

    for n in list(graph.nodes):
        visit(n, set())
    graph.nodes = order
