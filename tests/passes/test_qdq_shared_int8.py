"""``BuilderConfig.qdq_shared_int8`` (``kiln build --qdq-shared-int8``, off by default): a QDQ
model's Q/DQ pair read both by a layer with a constant weight and by another op (a LayerNorm
output feeding a Linear and the residual Add) makes the layer INT8 on the pair's codes, while
the Add keeps the dequantized values. Structure and counts on and off, the must-not-fire case
(no weight layer among the readers), numerics against onnxruntime, the CLI flag."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.builder import Builder, BuilderConfig
from tests.ort_util import calibration_reader

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def residual_qdq(tmp_path_factory):
    """LayerNorm -> (Linear -> ReLU -> Linear) + the LayerNorm's output, quantized by
    onnxruntime's quantize_static (QDQ, int8 activations and weights)."""
    pytest.importorskip("onnxruntime")
    import torch
    from onnxruntime.quantization import (
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.l1, self.l2 = (torch.nn.LayerNorm(32), torch.nn.Linear(32, 64),
                                         torch.nn.Linear(64, 32))

        def forward(self, x):
            h = self.ln(x)
            return h + self.l2(torch.relu(self.l1(h)))

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("shared")
    src, out = d / "res.onnx", d / "res.qdq.onnx"
    torch.onnx.export(M().eval(), (torch.randn(2, 8, 32),), str(src), input_names=["x"],
                      output_names=["y"], dynamo=False)

    rng = np.random.default_rng(5)
    reader = calibration_reader([{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)}
                                 for _ in range(4)])
    quantize_static(str(src), str(out), reader, quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return out


def _x():
    return {"x": np.random.default_rng(6).standard_normal((2, 8, 32)).astype(np.float32)}


@pytest.mark.parametrize("shared", [False, True])
def test_shared_pair_feeds_an_int8_layer_only_when_asked(residual_qdq, shared):
    import onnxruntime as ort

    logs = []
    e = Builder(BuilderConfig(qdq_shared_int8=shared), log=logs.append).build(residual_qdq)
    kinds = Counter(e.choices.values())
    # the second Linear's pair is read by it alone: INT8 either way; the first reads the
    # LayerNorm's pair, which the residual Add reads too
    assert kinds["TorchInt8MatMulQDQ"] == (2 if shared else 1)
    assert kinds["TorchMatMul"] == (0 if shared else 1)
    assert kinds["TorchQuantizeDequantize"] >= 1  # the Add still reads the dequantized values
    said = any("1 of them also read by INT8 layers on their codes" in m for m in logs)
    assert said == shared
    ctx = e.create_context()
    first = np.asarray(ctx.run(_x())["y"]).copy()
    got = np.asarray(ctx.run(_x())["y"])
    want = ort.InferenceSession(str(residual_qdq)).run(None, _x())[0]
    np.testing.assert_array_equal(got, first)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_must_not_fire_without_a_weight_layer(tmp_path):
    """A pair read by an Add and a Softmax only: nothing to make INT8, shared or not."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("Add", ["d", "x"], ["a"]),
             helper.make_node("Softmax", ["d"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    g = helper.make_graph(
        nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 40])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.037]),
         helper.make_tensor("z", TensorProto.INT8, [], [-5])])
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(p))
    kinds = [Counter(Builder(BuilderConfig(qdq_shared_int8=s)).build(p).choices.values())
             for s in (False, True)]
    assert kinds[0] == kinds[1]
    assert not any("Int8" in k for k in kinds[1])


def test_cli_flag(residual_qdq, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "kiln.cli.main", "build", str(residual_qdq), "-o",
                        str(tmp_path / "m.kiln"), "--qdq-shared-int8", "--verbose"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "also read by INT8 layers on their codes (qdq_shared_int8)" in p.stdout + p.stderr
