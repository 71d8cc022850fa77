"""Helpers for the transformer fusion tests: tiny ONNX graphs, one pass, before/after runs."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.engine.executor import Executor
from kiln.frontend import import_onnx
from kiln.passes.verifier import verify

RNG = np.random.default_rng(0)


def model(nodes, inputs: dict, outputs: list[str], inits: dict | None = None,
          opset: int = 17) -> onnx.ModelProto:
    """inputs: name -> shape (float32, str dims are symbolic); inits: name -> array."""
    vin = [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in inputs.items()]
    vout = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs]
    init = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    g = helper.make_graph(nodes, "t", vin, vout, init)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def node(op, ins, outs, name=None, **attrs):
    return helper.make_node(op, ins, outs if isinstance(outs, list) else [outs],
                            name=name or (outs if isinstance(outs, str) else outs[0]), **attrs)


def run(graph, feeds: dict) -> list[np.ndarray]:
    args = [torch.from_numpy(feeds[v.name]) for v in graph.inputs]
    return [o.numpy() for o in Executor(graph).run(args)]


def apply(m: onnx.ModelProto, fn, feeds: dict, rtol=1e-5, atol=1e-5):
    """Run pass ``fn`` on ``m``; check the verifier and that outputs are unchanged.
    Returns (graph after, counts before, counts after, rewrites, log lines)."""
    g = import_onnx(m)
    before, ref = g.op_counts(), run(g, feeds)
    logs: list[str] = []
    n = fn(g, logs.append)
    verify(g, after="test")
    for a, b in zip(run(g, feeds), ref):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return g, before, g.op_counts(), n, logs


def feeds(**shapes) -> dict:
    return {k: RNG.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def c(x) -> np.ndarray:
    return np.asarray(x, np.float32)
