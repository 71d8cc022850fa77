"""Runs a graph as a flat list of launch records over numbered value slots.

The records are made once; running walks the list, reads each kernel's inputs from slots,
writes its outputs back and clears slots after their last reader, so memory follows lifetimes.
"""

from __future__ import annotations

from typing import Callable

import torch

import kiln.kernels.torch  # noqa: F401  (registers the CPU kernels)
from kiln.errors import KernelError, KilnError
from kiln.ir import Graph, Node
from kiln.kernels.registry import Call, kernels_for
from kiln.kernels.torch.convert import to_torch


def default_choice(node: Node, backend: str):
    ks = kernels_for(node.op, backend)
    if not ks:
        raise KilnError(f"node '{node.name}': op {node.op.qualname} has no {backend} kernel")
    return ks[0]


class Step:
    __slots__ = ("fn", "call", "ins", "outs", "free", "node")

    def __init__(self, fn, call, ins, outs, free, node):
        self.fn, self.call, self.ins, self.outs, self.free, self.node = (
            fn, call, ins, outs, free, node)


class Executor:
    """Executes ``graph`` with the kernels ``choose(node, backend)`` picks."""

    def __init__(self, graph: Graph, backend: str = "cpu",
                 choose: Callable = default_choice, opset: dict | None = None):
        self.graph, self.backend, self.choose = graph, backend, choose
        self.opset = dict(opset or {}, **graph.opset)
        slot: dict[int, int] = {}

        def slot_of(v) -> int:
            if id(v) not in slot:
                slot[id(v)] = len(slot)
            return slot[id(v)]

        self.input_slots = [slot_of(v) for v in graph.inputs + graph.captures]
        self.consts = [(slot_of(v), to_torch(v.const)) for v in graph.weights.values()]
        for n in graph.nodes:  # folded constants that live on node-less values
            for v in n.inputs:
                if v is not None and v.const is not None and id(v) not in slot:
                    self.consts.append((slot_of(v), to_torch(v.const)))
        self.steps = [self._step(n, slot_of) for n in graph.nodes]
        self.output_slots = [slot_of(v) for v in graph.outputs]
        self.n_slots = len(slot)
        self._plan_frees()

    def _step(self, node: Node, slot_of) -> Step:
        kernel = self.choose(node, self.backend)
        subgraphs = node.subgraphs()
        n_caps = len({c.name for g in subgraphs for c in g.captures})
        call = Call(node.attrs, len(node.outputs), len(node.inputs) - n_caps, node.name,
                    tuple(v.type for v in node.outputs), opset=self.opset.get(node.op.domain, 0))
        if subgraphs:
            call.run_graph = _SubgraphRunner(node, subgraphs, n_caps, self.backend, self.choose,
                                             self.opset)
        ins = tuple(-1 if v is None else slot_of(v) for v in node.inputs)
        outs = tuple(slot_of(v) for v in node.outputs)
        return Step(kernel.fn, call, ins, outs, (), node)

    def _plan_frees(self) -> None:
        keep = set(self.output_slots) | {s for s, _ in self.consts}
        last: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for s in st.ins + st.outs:
                if s >= 0:
                    last[s] = i
        frees: dict[int, list[int]] = {}
        for s, i in last.items():
            if s not in keep:
                frees.setdefault(i, []).append(s)
        for i, st in enumerate(self.steps):
            st.free = tuple(frees.get(i, ()))

    def run(self, args: list, timer=None) -> list:
        """Run once. ``timer(step_index, seconds)``, when given, receives every step's time
        (a profiling run: slower, as each step is synchronised)."""
        if timer is not None:
            return self._run_timed(args, timer)
        env: list = [None] * self.n_slots
        for s, v in zip(self.input_slots, args):
            env[s] = v
        for s, c in self.consts:
            env[s] = c
        with torch.inference_mode():
            for st in self.steps:
                try:
                    out = st.fn(st.call, *[env[i] if i >= 0 else None for i in st.ins])
                except KilnError:
                    raise
                except Exception as e:
                    raise KernelError(
                        f"node '{st.node.name}' ({st.node.op.qualname}) failed: "
                        f"{type(e).__name__}: {e}") from e
                if len(st.outs) == 1:
                    env[st.outs[0]] = out[0] if isinstance(out, tuple) else out
                else:
                    for s, o in zip(st.outs, out):
                        env[s] = o
                for s in st.free:
                    env[s] = None
        return [env[s] for s in self.output_slots]


    def _run_timed(self, args: list, timer) -> list:
        import time

        env: list = [None] * self.n_slots
        for s, v in zip(self.input_slots, args):
            env[s] = v
        for s, c in self.consts:
            env[s] = c
        with torch.inference_mode():
            for k, st in enumerate(self.steps):
                t0 = time.perf_counter()
                out = st.fn(st.call, *[env[i] if i >= 0 else None for i in st.ins])
                timer(k, time.perf_counter() - t0)
                outs = out if len(st.outs) > 1 else (
                    (out[0] if isinstance(out, tuple) else out),)
                for s, o in zip(st.outs, outs):
                    env[s] = o
        return [env[s] for s in self.output_slots]


class _SubgraphRunner:
    """``call.run_graph(graph, args, captured)``: runs one of the node's subgraphs, handing it
    the captured outer values it reads."""

    def __init__(self, node: Node, subgraphs: list[Graph], n_caps: int, backend, choose,
                 opset: dict):
        # the frontend appended the captured outer values to the node's inputs, in order
        names = [v.name for v in node.inputs[len(node.inputs) - n_caps:]] if n_caps else []
        self.index = {id(g): [names.index(c.name) for c in g.captures] for g in subgraphs}
        self.execs = {id(g): Executor(g, backend, choose, opset) for g in subgraphs}

    def __call__(self, graph: Graph, args: list, captured) -> list:
        caps = [captured[i] for i in self.index[id(graph)]]
        return self.execs[id(graph)].run(list(args) + caps)
