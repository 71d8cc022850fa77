"""Expanding ONNX ops that the spec defines as functions of other ops.

An op kiln has no OpDef for, but whose ONNX schema carries a function body (``Mish``,
``Gelu``...), is replaced at import by the nodes of that body.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, FunctionProto, NodeProto

from kiln.ir import TensorType


def find_function(node: NodeProto, domain: str, version: int, in_types: list):
    try:
        schema = onnx.defs.get_schema(node.op_type, version, domain)
    except onnx.defs.SchemaError:
        return None
    if schema.has_function:
        fn = schema.get_function_with_opset_version(version) or schema.function_body
        return fn if fn.node else None
    if schema.has_context_dependent_function:
        if any(not isinstance(t, TensorType) or t.dtype is None for t in in_types):
            return None
        protos = [onnx.helper.make_tensor_type_proto(t.dtype.onnx, None).SerializeToString()
                  for t in in_types]
        try:
            body = schema.get_context_dependent_function_with_opset_version(
                version, node.SerializeToString(), protos)
        except Exception:  # the schema refuses this node's attributes/types
            return None
        fn = FunctionProto()
        fn.ParseFromString(body)
        return fn if fn.node else None
    return None


def expand_function(node: NodeProto, fn: FunctionProto, prefix: str) -> list[NodeProto]:
    rename = {}
    for i, name in enumerate(fn.input):
        rename[name] = node.input[i] if i < len(node.input) else ""
    for i, name in enumerate(fn.output):
        rename[name] = node.output[i] if i < len(node.output) else ""
    given = {a.name: a for a in node.attribute}
    defaults = {a.name: a for a in fn.attribute_proto}

    def name_of(n: str) -> str:
        if not n:
            return ""
        return rename.setdefault(n, f"{prefix}/{n}")

    out = []
    for k, inner in enumerate(fn.node):
        new = NodeProto()
        new.CopyFrom(inner)
        new.name = f"{prefix}/{inner.name or inner.op_type + str(k)}"
        new.input[:] = [name_of(n) for n in inner.input]
        new.output[:] = [name_of(n) for n in inner.output]
        attrs = []
        for a in inner.attribute:
            if a.ref_attr_name:
                src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                if src is None:
                    continue
                b = AttributeProto()
                b.CopyFrom(src)
                b.name = a.name
                attrs.append(b)
            else:
                attrs.append(a)
        del new.attribute[:]
        new.attribute.extend(attrs)
        out.append(new)
    return out
