"""Single-node ONNX models run through kiln and compared with an independent oracle."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

import kiln.onnx_backend as backend
from kiln.ir import DType

# tolerances per dtype, in one place: (rtol, atol)
TOLERANCE = {
    DType.float64: (1e-7, 1e-9), DType.float32: (1e-5, 1e-6), DType.float16: (1e-3, 1e-3),
    DType.bfloat16: (1e-2, 1e-2),
}


def node_model(op_type: str, inputs: dict[str, np.ndarray], n_out: int = 1,
               opset: int | None = None, domain: str = "", **attrs) -> onnx.ModelProto:
    """A model with one node reading ``inputs`` (name -> sample array) and writing y0..yN."""
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op_type, list(inputs), outs, domain=domain, **attrs)
    vin = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items()]
    vout = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs]
    opsets = [helper.make_opsetid("", opset or onnx.defs.onnx_opset_version())]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(helper.make_graph([node], "t", vin, vout), opset_imports=opsets)


def run_kiln(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    return list(backend.prepare(model).run(inputs))


def run_reference(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    return list(ReferenceEvaluator(model).run(None, inputs))


def check_against_reference(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> None:
    got, want = run_kiln(model, inputs), run_reference(model, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_close(g, np.asarray(w))


def assert_close(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    if want.dtype == object or want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    rtol, atol = TOLERANCE.get(DType.from_np(want.dtype), (1e-5, 1e-6))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=atol)
