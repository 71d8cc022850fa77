"""kiln's intermediate representation: graphs of typed values and OpDef nodes."""

from kiln.ir.dtype import DType
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.opdef import REGISTRY, REQUIRED, Attr, InferCtx, OpDef
from kiln.ir.types import OptionalType, SequenceType, TensorType, as_dim, dim_str, sym

__all__ = [
    "DType", "Graph", "Node", "Value", "REGISTRY", "REQUIRED", "Attr", "InferCtx", "OpDef",
    "OptionalType", "SequenceType", "TensorType", "as_dim", "dim_str", "sym",
]
