"""kiln types <-> ONNX TypeProto."""

from __future__ import annotations

import re

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
        # Paddle and some converters write a dynamic dim as -1 or 0; onnxruntime reads those as
        # unknown, and so does kiln (a graph input's unknown dims get names at import)
        return int(d.dim_value) if d.dim_value > 0 else None
    if d.HasField("dim_param") and d.dim_param:
        return dim_from_str(d.dim_param, known) if known is not None else sym(d.dim_param)
    return None


def name_free_dims(t, value: str):
    """``t`` with each unknown dim of a tensor type named after ``value`` and its position
    (``x_dim0``), so that the shape rules can follow it like a ``dim_param``."""
    if not isinstance(t, TensorType) or t.shape is None or None not in t.shape:
        return t
    base = re.sub(r"\W", "_", value)
    base = base if base[:1].isalpha() else f"v_{base}"
    return TensorType(t.dtype, tuple(sym(f"{base}_dim{k}") if d is None else d
                                     for k, d in enumerate(t.shape)))


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
