"""Kernel implementations, registered per (OpDef, backend).

A kernel is ``fn(call, *inputs) -> output | tuple of outputs``. ``call`` is the per-node
:class:`Call` (attributes, output count, subgraph runner); inputs are torch tensors, numpy arrays
for dtypes torch lacks (strings, 4-bit types), Python lists for sequences, and None for omitted
optional inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.ir import OpDef

BACKENDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Kernel:
    op: OpDef
    backend: str
    fn: Callable
    name: str
    tactics: tuple = ()


@dataclass
class Call:
    """What a kernel knows about the node it runs: fixed when the plan is made."""

    attrs: Any
    n_out: int
    n_in: int  # declared inputs; inputs beyond these are values captured by subgraphs
    node_name: str = ""
    out_types: tuple = ()
    run_graph: Callable | None = None  # (graph, args, captured) -> list of outputs
    opset: int = 0  # the model's opset version for the node's domain
    cache: dict = field(default_factory=dict)

    @property
    def a(self):
        return self.attrs


_KERNELS: dict[tuple[OpDef, str], list[Kernel]] = {}


def register(*ops: OpDef, backend: str = "cpu", name: str | None = None):
    """Decorator: ``@register(ops.Relu)`` makes ``fn`` the CPU kernel of Relu."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")

    def deco(fn):
        for op in ops:
            k = Kernel(op, backend, fn, name or f"Torch{op.name}")
            _KERNELS.setdefault((op, backend), []).append(k)
        return fn
    return deco


def kernels_for(op: OpDef, backend: str = "cpu") -> list[Kernel]:
    return list(_KERNELS.get((op, backend), ()))


def has_kernel(op: OpDef, backend: str = "cpu") -> bool:
    return bool(_KERNELS.get((op, backend)))
