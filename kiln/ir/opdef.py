"""OpDef: everything kiln knows about one operator except its kernels.

An OpDef holds the attribute schema (a frozen dataclass generated per op), the shape/dtype rule and
the ONNX mapping. OpDefs are compared by identity; kernels, fusion rules and printers key on the
object, never on its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

REQUIRED = object()

# attribute kinds, as ONNX names them
ATTR_KINDS = ("int", "float", "string", "ints", "floats", "strings", "tensor", "tensors",
              "graph", "graphs", "type", "types", "sparse_tensor", "sparse_tensors")


@dataclass(frozen=True)
class Attr:
    kind: str
    default: Any = None  # REQUIRED when the attribute must be given


@dataclass
class InferCtx:
    """What a shape rule sees: input types, constant input values, symbolic int values."""

    attrs: Any
    in_types: list
    in_values: list  # numpy array for inputs known at build time, else None
    in_syms: list  # tuple of dims for small int64 vectors known symbolically, else None
    n_out: int
    out_syms: list = dataclasses.field(default_factory=list)

    def type(self, i: int):
        return self.in_types[i] if i < len(self.in_types) else None

    def shape(self, i: int):
        t = self.type(i)
        return getattr(t, "shape", None)

    def dtype(self, i: int):
        t = self.type(i)
        return getattr(t, "dtype", None)

    def value(self, i: int) -> np.ndarray | None:
        return self.in_values[i] if i < len(self.in_values) else None

    def sym(self, i: int) -> tuple | None:
        """Symbolic contents of a small int vector input (constant or derived from shapes)."""
        if i < len(self.in_syms) and self.in_syms[i] is not None:
            return self.in_syms[i]
        v = self.value(i)
        if v is not None and v.dtype.kind in "iu" and v.ndim <= 1:
            return tuple(int(x) for x in v.reshape(-1))
        return None

    def has(self, i: int) -> bool:
        return i < len(self.in_types) and self.in_types[i] is not None


class OpDef:
    """One operator. ``infer(ctx) -> list[Type]`` returns the output types."""

    def __init__(self, name: str, attrs: dict[str, Attr] | None = None, *, domain: str = "",
                 infer: Callable[[InferCtx], list] | None = None, versions: tuple = (),
                 num_outputs_attr: bool = False, doc: str = ""):
        self.name = name
        self.domain = domain
        self.attrs = dict(attrs or {})
        self.infer = infer
        self.versions = versions  # opset versions in which ONNX changed this op
        self.num_outputs_attr = num_outputs_attr
        self.doc = doc
        fields = [(k, Any, dataclasses.field(default=None if a.default is REQUIRED else a.default))
                  for k, a in self.attrs.items()]
        if num_outputs_attr and "n_out" not in self.attrs:
            fields.append(("n_out", int, dataclasses.field(default=1)))
        self.Attrs = dataclasses.make_dataclass(f"{name}Attrs", fields, frozen=True, eq=False)

    @property
    def qualname(self) -> str:
        return f"{self.domain}::{self.name}" if self.domain else self.name

    def make_attrs(self, **kw):
        unknown = set(kw) - {f.name for f in dataclasses.fields(self.Attrs)}
        if unknown:
            raise TypeError(f"{self.name} has no attribute(s) {sorted(unknown)}")
        return self.Attrs(**kw)

    def __repr__(self) -> str:
        return f"OpDef({self.qualname})"


class OpRegistry:
    """All OpDefs by (domain, name). Filled by ``kiln.ops`` at import time."""

    def __init__(self):
        self._ops: dict[tuple[str, str], OpDef] = {}

    def add(self, op: OpDef) -> OpDef:
        key = (op.domain, op.name)
        if key in self._ops:
            raise ValueError(f"op {op.qualname} registered twice")
        self._ops[key] = op
        return op

    def get(self, domain: str, name: str) -> OpDef | None:
        domain = "" if domain == "ai.onnx" else domain
        return self._ops.get((domain, name))

    def __iter__(self):
        return iter(sorted(self._ops.values(), key=lambda o: (o.domain, o.name)))

    def __len__(self) -> int:
        return len(self._ops)


REGISTRY = OpRegistry()
