"""Elementwise math: arithmetic, comparisons, logic, bitwise and activations."""

from kiln.ir import DType
from kiln.ops.rules import broadcast, same
from kiln.ops.schema import onnx_op

Add = onnx_op("Add", broadcast())
Relu = onnx_op("Relu", same())
Equal = onnx_op("Equal", broadcast(DType.bool))
