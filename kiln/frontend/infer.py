"""Shape and dtype inference at import: the OpDef's rule first, ONNX's own inference for ops
whose OpDef has none, and the model's value_info as the last word for what is still unknown."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import NodeProto, numpy_helper

from kiln.frontend.typeproto import type_from_proto, type_to_proto
from kiln.ir import InferCtx, Node, TensorType

_SMALL = 4096  # constant inputs up to this many elements are handed to ONNX's inference


def infer_node(node: Node, proto: NodeProto, opset: dict[str, int], hints: dict) -> None:
    ins = node.inputs
    ctx = InferCtx(node.attrs, [v.type if v is not None else None for v in ins],
                   [v.const if v is not None else None for v in ins],
                   [v.sym if v is not None else None for v in ins], len(node.outputs))
    types: list = []
    if node.op.infer is not None:
        try:
            types = list(node.op.infer(ctx))
        except Exception:  # a rule that cannot cope leaves the types to the fallbacks below
            types = []
    types += [None] * (len(node.outputs) - len(types))
    if any(not _complete(t) for t in types):
        onnx_types = _onnx_infer(node, proto, opset)
        types = [t if _complete(t) or o is None else o for t, o in zip(types, onnx_types)]
    for i, (v, t) in enumerate(zip(node.outputs, types)):
        if not _complete(t) and v.name in hints:
            t = type_from_proto(hints[v.name], f"value '{v.name}'") or t
        v.type = t
        if i < len(ctx.out_syms):
            v.sym = ctx.out_syms[i]


def _complete(t) -> bool:
    if t is None:
        return False
    if isinstance(t, TensorType):
        return t.dtype is not None and t.shape is not None
    return True


def _onnx_infer(node: Node, proto: NodeProto, opset: dict[str, int]) -> list:
    domain = "" if proto.domain in ("", "ai.onnx") else proto.domain
    try:
        schema = onnx.defs.get_schema(proto.op_type, opset.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return [None] * len(node.outputs)
    known = {}
    in_types, in_data = {}, {}
    for name, v in zip(proto.input, node.inputs):
        if not name or v is None:
            continue
        tp = type_to_proto(v.type)
        if tp is not None:
            in_types[name] = tp
        for d in getattr(v.type, "shape", None) or ():
            if d is not None and not isinstance(d, int):
                known[str(d)] = d
        if v.const is not None and v.const.size <= _SMALL and v.const.dtype != object:
            try:
                in_data[name] = numpy_helper.from_array(np.asarray(v.const), name)
            except Exception:
                pass
    try:
        out = onnx.shape_inference.infer_node_outputs(
            schema, proto, in_types, in_data,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opset.items()])
    except Exception:
        return [None] * len(node.outputs)
    return [type_from_proto(out[o], f"value '{o}'", known) if o in out else None
            for o in proto.output]
