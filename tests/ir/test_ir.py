"""IR: the op registry is covered by kernels, the verifier catches broken graphs, the printer
prints what is there."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln.kernels.torch
import kiln.ops
from kiln.frontend import import_onnx
from kiln.ir import DType, Node, TensorType, Value
from kiln.ir.printer import format_graph
from kiln.kernels.registry import has_kernel
from kiln.passes.verifier import VerifyError, verify


def test_ir_every_op_has_a_cpu_kernel():
    missing = [op.qualname for op in kiln.ops.REGISTRY if not has_kernel(op, "cpu")]
    assert missing == []
    assert len(kiln.ops.REGISTRY) > 180


def test_ir_dtypes_cover_onnx():
    from onnx import TensorProto as T

    for name, code in T.DataType.items():
        if code:
            assert DType.from_onnx(code).onnx == code, name
    assert DType.float8e4m3fn.is_float and DType.int4.is_int and DType.bfloat16.itemsize == 2


def _graph():
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Relu", ["h"], ["y"], name="act")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["n", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_ir_printer_shows_types_ops_and_names():
    text = format_graph(_graph())
    assert "graph g(%x: float32[n,4]) -> (%y)" in text
    assert "%h: float32[n,3] = MatMul(%x, %w)" in text and "# fc" in text
    assert "weights: %w float32[4,3]" in text


def test_ir_verifier_accepts_imported_graph():
    verify(_graph())


def test_ir_verifier_catches_use_before_definition():
    g = _graph()
    g.nodes.reverse()
    with pytest.raises(VerifyError, match="reads 'h' before it is defined"):
        verify(g)


def test_ir_verifier_catches_duplicate_definition():
    g = _graph()
    relu = g.nodes[1]
    g.nodes.append(Node(relu.op, "again", [g.nodes[0].outputs[0]], [relu.outputs[0]]))
    with pytest.raises(VerifyError, match="defined twice|used twice|producer"):
        verify(g)


def test_ir_verifier_catches_dangling_output():
    g = _graph()
    g.outputs.append(Value("ghost", TensorType(DType.float32, (1,))))
    with pytest.raises(VerifyError, match="output 'ghost' is never defined"):
        verify(g)
