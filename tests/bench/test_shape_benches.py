"""bench.gemm_shapes and bench.conv_shapes: their one-layer models compute what they claim, and
a run on a small shape checks kiln against onnxruntime and exits 0."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from bench import conv_shapes, gemm_shapes
from kiln import native


def test_matmul_add_model_is_x_w_plus_b():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 7), dtype=np.float32)
    b = rng.standard_normal(7, dtype=np.float32)
    x = rng.standard_normal((3, 5), dtype=np.float32)
    sess = ort.InferenceSession(gemm_shapes.matmul_add_model(w, b, 3),
                                providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w + b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride", [1, 2])
def test_conv_model_is_same_padded_conv_relu(stride):
    model = conv_shapes.conv_model(3, 9, 7, 5, 3, 3, stride)
    w = torch.from_numpy(np.array(
        [np.frombuffer(i.raw_data, np.float32) for i in model.graph.initializer if i.name == "w"]
    ).reshape(5, 3, 3, 3))
    b = torch.from_numpy(np.frombuffer(
        [i for i in model.graph.initializer if i.name == "b"][0].raw_data, np.float32).copy())
    x = np.random.default_rng(2).standard_normal((1, 3, 9, 7)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), w, b, stride, 1))
    got = sess.run(None, {"x": x})[0]
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available, reason="kiln's native kernels are not built")
def test_gemm_shapes_runs_an_odd_shape(capsys):
    gemm_shapes.main(["13x29x37", "--runs", "1", "--repeats", "1", "--threads", "1"])
    assert "13x29x37: kiln" in capsys.readouterr().out


@pytest.mark.skipif(not native.available, reason="kiln's native kernels are not built")
def test_conv_shapes_runs_and_agrees(capsys):
    assert conv_shapes.main(["5x11x9:7x3x3s2", "--runs", "1", "--repeats", "1"]) == 0
    assert "5x11x9:7x3x3s2: kiln" in capsys.readouterr().out
