"""Conv weights on a device executor are stored channels_last, once (kiln.engine.executor).

The meta device stands in for a GPU on the CPU (the executor treats every non-CPU device alike);
the numerics run on the CPU, calling the helper directly, and on a GPU where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.precision import lower_precision
from kiln.engine.executor import Executor, _conv_weights_channels_last
from kiln.frontend import import_onnx
from kiln.ops import fused_conv as FC
from kiln.passes.pipeline import optimize

CL = torch.channels_last


def _conv_model(shared: bool = False):
    """x[1, 3, 8, 8] -> Conv(w[4, 3, 3, 3], b) -> Relu -> y; with ``shared``, also
    z = w * s (s a graph input), so w has a second reader."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])]
    if shared:
        nodes.append(helper.make_node("Mul", ["w", "s"], ["z"], name="mul"))
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [4, 3, 3, 3]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 3, 3, 3]))
    g = helper.make_graph(nodes, "conv", inputs, outputs, [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _graph(precision: str | None = "fp16", shared: bool = False):
    graph = optimize(import_onnx(_conv_model(shared)))
    if precision:
        lower_precision(graph, precision)
    return graph


def _conv_weight(ex: Executor) -> torch.Tensor:
    st = next(st for st in ex.steps if st.node.op is FC.FusedConv)
    return dict(ex.consts)[st.ins[1]]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_device_executor_stores_conv_weight_channels_last(precision):
    ex = Executor(_graph(precision), "cpu", device=torch.device("meta"))
    w = _conv_weight(ex)
    assert w.device.type == "meta" and w.shape == (4, 3, 3, 3)
    assert w.is_contiguous(memory_format=CL) and not w.is_contiguous()
    assert ex.device_weight_bytes == w.numel() * w.element_size() + 4 * w.element_size()


def test_no_channels_last_for_conv_weight_read_elsewhere():
    ex = Executor(_graph(shared=True), "cpu", device=torch.device("meta"))
    assert _conv_weight(ex).is_contiguous()


def test_no_channels_last_for_fp32_conv_weight():
    ex = Executor(_graph(None), "cpu", device=torch.device("meta"))
    w = _conv_weight(ex)
    assert w.dtype == torch.float32 and w.is_contiguous()


def test_no_channels_last_on_a_cpu_executor():
    assert _conv_weight(Executor(_graph(), "cpu")).is_contiguous()


def test_channels_last_conv_weight_same_outputs():
    """Called directly on a CPU executor: the outputs do not change."""
    ex = Executor(_graph(shared=True), "cpu")
    rng = np.random.default_rng(1)
    args = [torch.from_numpy(rng.standard_normal((1, 3, 8, 8)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))]
    before = ex.run(args)
    k, mul = next((k, st) for k, st in enumerate(ex.steps) if st.node.op.name == "Mul")
    del ex.steps[k]  # the conv is now the weight's only reader: the helper converts it
    _conv_weights_channels_last(ex)
    assert _conv_weight(ex).is_contiguous(memory_format=CL)
    ex.steps.insert(k, mul)  # and a torch kernel reading the channels-last weight reads it right
    after = ex.run(args)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)  # same values, any algorithm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_conv_weight_on_the_device_once():
    engine = kiln.Builder(kiln.BuilderConfig(device="cuda", fp16=True)).build(_conv_model())
    w = _conv_weight(engine._executor)
    assert w.is_cuda and w.is_contiguous(memory_format=CL)
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    y = engine.create_context().run({"x": x})["y"]
    cpu = kiln.Builder(kiln.BuilderConfig(fp16=True)).build(_conv_model())
    np.testing.assert_allclose(y, cpu.create_context().run({"x": x})["y"], rtol=2e-2, atol=2e-2)
    # no second copy of the weight in the kernels' caches: their channels-last weight is it
    cached = [t for st in engine._executor.steps for v in st.call.cache.values()
              if isinstance(v, tuple) for t in v if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for t in cached)
