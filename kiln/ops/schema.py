"""Build OpDefs for ONNX operators from the ONNX spec itself.

The attribute schema of an ONNX op is the union of its attributes over every opset version the
installed ``onnx`` knows (renamed or retired attributes stay readable, so old models load), with
the newest version's default. The op's versions are recorded as its ONNX mapping.
"""

from __future__ import annotations

import functools

import onnx
from onnx import AttributeProto, defs

from kiln.ir.opdef import REGISTRY, REQUIRED, Attr, OpDef

_KIND = {
    AttributeProto.INT: "int", AttributeProto.FLOAT: "float", AttributeProto.STRING: "string",
    AttributeProto.INTS: "ints", AttributeProto.FLOATS: "floats",
    AttributeProto.STRINGS: "strings", AttributeProto.TENSOR: "tensor",
    AttributeProto.TENSORS: "tensors", AttributeProto.GRAPH: "graph",
    AttributeProto.GRAPHS: "graphs", AttributeProto.TYPE_PROTO: "type",
    AttributeProto.TYPE_PROTOS: "types", AttributeProto.SPARSE_TENSOR: "sparse_tensor",
    AttributeProto.SPARSE_TENSORS: "sparse_tensors",
}


@functools.cache
def _history() -> dict[tuple[str, str], list]:
    by_op: dict[tuple[str, str], list] = {}
    for s in defs.get_all_schemas_with_history():
        by_op.setdefault((s.domain, s.name), []).append(s)
    for v in by_op.values():
        v.sort(key=lambda s: s.since_version)
    return by_op


def attr_default(proto: AttributeProto):
    if proto is None or proto.type == AttributeProto.UNDEFINED:
        return None
    kind = _KIND.get(proto.type)
    v = onnx.helper.get_attribute_value(proto)
    if kind == "string":
        return v.decode() if isinstance(v, bytes) else v
    if kind == "strings":
        return tuple(x.decode() if isinstance(x, bytes) else x for x in v)
    if kind in ("ints", "floats"):
        return tuple(v)
    if kind in ("int", "float"):
        return v
    return None


def onnx_schemas(name: str, domain: str = "") -> list:
    return _history().get((domain, name), [])


def onnx_op(name: str, infer=None, *, domain: str = "", num_outputs_attr: bool = False,
            extra: dict[str, Attr] | None = None) -> OpDef:
    """Define and register the OpDef of an ONNX operator."""
    history = onnx_schemas(name, domain)
    if not history:
        raise KeyError(f"onnx {onnx.__version__} has no schema for {domain or 'ai.onnx'}::{name}")
    attrs: dict[str, Attr] = {}
    for schema in history:  # oldest first: newer versions override kinds and defaults
        for an, a in schema.attributes.items():
            default = REQUIRED if a.required else attr_default(a.default_value)
            attrs[an] = Attr(_KIND.get(a.type, "unknown"), default)
    attrs.update(extra or {})
    op = OpDef(name, attrs, domain=domain, infer=infer,
               versions=tuple(s.since_version for s in history),
               num_outputs_attr=num_outputs_attr, doc=history[-1].doc[:200])
    return REGISTRY.add(op)


def kiln_op(name: str, attrs: dict[str, Attr], infer=None, doc: str = "") -> OpDef:
    """Define and register an op of kiln's own (fusions), in the ``kiln`` domain."""
    return REGISTRY.add(OpDef(name, attrs, domain="kiln", infer=infer, doc=doc))
