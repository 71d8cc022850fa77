"""Kernel implementations, registered per (OpDef, backend).

A kernel is ``fn(call, *inputs) -> output | tuple of outputs``. ``call`` is the per-node
:class:`Call` (attributes, output count, subgraph runner); inputs are torch tensors, numpy arrays
for dtypes torch lacks (strings, 4-bit types), Python lists for sequences, and None for omitted
optional inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.ir import OpDef

BACKENDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Kernel:
    op: OpDef
    backend: str
    fn: Callable
    name: str
    # tactic space: a tuple of dicts, or ``(call, inputs) -> list[dict]`` when it depends on
    # the shapes; () means the kernel has no tactics
    tactics: Any = ()
    # ``(call, inputs) -> bool``: can this kernel run this node with these inputs? None: always
    supports: Callable | None = None
    # ``(tactic) -> str | bool | None``: the CUDA library whose first use in a process this
    # tactic pays at an engine's first run: "cudnn" (or True: its initialisation, then a plan
    # per layer shape, milliseconds each), "cublas" (its initialisation, ~150 ms on the H200),
    # "sdpa" (PyTorch's flash/efficient attention kernels, loaded at first use, ~125 ms).
    # None: none. The builder prefers kernels that need no library, within a margin
    # (autotune.select per layer for cuDNN's plans, autotune.drop_plans per library)
    makes_plan: Callable | None = None

    def library(self, tactic) -> str | None:
        v = self.makes_plan(tactic) if self.makes_plan is not None else None
        return "cudnn" if v is True else (v or None)

    def plans(self, tactic) -> bool:
        """Does this tactic make a cuDNN plan per layer shape at its first call?"""
        return self.library(tactic) == "cudnn"

    def tactic_space(self, call, inputs) -> list:
        space = self.tactics(call, inputs) if callable(self.tactics) else self.tactics
        return list(space) or [None]

    def can_run(self, call, inputs) -> bool:
        return self.supports is None or bool(self.supports(call, inputs))


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
    tactic: dict | None = None  # the builder's pick from the kernel's tactic space

    @property
    def a(self):
        return self.attrs

    @classmethod
    def of(cls, node, opset: dict, n_caps: int = 0, **kw) -> Call:
        """The Call of an IR node; ``n_caps`` trailing inputs are subgraph captures."""
        return cls(node.attrs, len(node.outputs), len(node.inputs) - n_caps, node.name,
                   tuple(v.type for v in node.outputs), opset=opset.get(node.op.domain, 0), **kw)


_KERNELS: dict[tuple[OpDef, str], list[Kernel]] = {}


def cudnn(_tactic=None) -> str:
    """``makes_plan`` of the PyTorch kernels that run cuDNN on CUDA tensors (convolutions)."""
    return "cudnn"


def cublas(_tactic=None) -> str:
    """``makes_plan`` of the PyTorch kernels that run cuBLAS on CUDA tensors (GEMMs)."""
    return "cublas"


def sdpa(_tactic=None) -> str:
    """``makes_plan`` of PyTorch's scaled_dot_product_attention on CUDA tensors."""
    return "sdpa"


def register(*ops: OpDef, backend: str = "cpu", name: str | None = None, tactics=(),
             supports: Callable | None = None, makes_plan: Callable | None = None):
    """Decorator: ``@register(ops.Relu)`` makes ``fn`` the CPU kernel of Relu.

    ``tactics``, ``supports`` and ``makes_plan`` are what the builder's autotuner reads (see
    :class:`Kernel`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")

    def deco(fn):
        for op in ops:
            k = Kernel(op, backend, fn, name or f"Torch{op.name}", tactics, supports, makes_plan)
            _KERNELS.setdefault((op, backend), []).append(k)
        return fn
    return deco


def kernels_for(op: OpDef, backend: str = "cpu") -> list[Kernel]:
    return list(_KERNELS.get((op, backend), ()))


def has_kernel(op: OpDef, backend: str = "cpu") -> bool:
    return bool(_KERNELS.get((op, backend)))
