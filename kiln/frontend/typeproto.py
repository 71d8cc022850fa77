"""kiln types <-> ONNX TypeProto."""

from __future__ import annotations

import onnx
from onnx import helper

from kiln.errors import ModelLoadError
from kiln.ir import DType, OptionalType, SequenceType, TensorType
from kiln.ir.types import dim_from_str, sym


def type_from_proto(tp: onnx.TypeProto, where: str, known: dict | None = None):
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        tt = getattr(tp, kind)
        dtype = None
        if tt.elem_type:
            try:
                dtype = DType.from_onnx(tt.elem_type)
            except ValueError:
                raise ModelLoadError(
                    f"{where} has element type {tt.elem_type}, which is not an ONNX data type "
                    "kiln knows; re-export with a standard dtype") from None
        shape = None
        if tt.HasField("shape"):
            shape = tuple(_dim(d, known) for d in tt.shape.dim)
        return TensorType(dtype, shape)
    if kind == "sequence_type":
        return SequenceType(type_from_proto(tp.sequence_type.elem_type, where, known))
    if kind == "optional_type":
        return OptionalType(type_from_proto(tp.optional_type.elem_type, where, known))
    if kind is None:
        return None
    raise ModelLoadError(f"{where} has type '{kind}', which kiln does not support")


def _dim(d, known):
    if d.HasField("dim_value"):
        return int(d.dim_value)
    if d.HasField("dim_param") and d.dim_param:
        return dim_from_str(d.dim_param, known) if known is not None else sym(d.dim_param)
    return None


def type_to_proto(t) -> onnx.TypeProto | None:
    if isinstance(t, TensorType):
        if t.dtype is None:
            return None
        shape = None if t.shape is None else [
            d if isinstance(d, int) else (None if d is None else str(d)) for d in t.shape]
        return helper.make_tensor_type_proto(t.dtype.onnx, shape)
    if isinstance(t, SequenceType):
        inner = type_to_proto(t.elem)
        return None if inner is None else helper.make_sequence_type_proto(inner)
    if isinstance(t, OptionalType):
        inner = type_to_proto(t.elem)
        return None if inner is None else helper.make_optional_type_proto(inner)
    return None
