"""DFT / STFT / window / MelWeightMatrix kernels against onnx.reference and NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ops.harness import check_against_reference, node_model, run_kiln, run_reference

RNG = np.random.default_rng(0)


def _close(m, inputs, atol=1e-4):
    for g, w in zip(run_kiln(m, inputs), run_reference(m, inputs)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("last", [1, 2])
@pytest.mark.parametrize("inverse,onesided", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("axis", [1, 2, -2])
def test_dft_opset20(last, inverse, onesided, axis):
    if inverse and onesided and last == 1:
        pytest.skip("a one-sided inverse needs a complex spectrum")
    if onesided and not inverse and last == 2:
        pytest.skip("one-sided forward DFT is defined for real input")
    x = RNG.standard_normal((2, 6, 5, last)).astype(np.float32)
    inputs = {"x": x, "len": np.array(8, np.int64), "axis": np.array(axis, np.int64)}
    m = node_model("DFT", inputs, inverse=inverse, onesided=onesided, opset=20)
    _close(m, inputs)


def test_dft_opset17_axis_attribute():
    x = RNG.standard_normal((3, 7, 4, 2)).astype(np.float32)
    m = node_model("DFT", {"x": x}, axis=2, opset=17)
    want = np.fft.fft(x[..., 0] + 1j * x[..., 1], axis=2)
    got = run_kiln(m, {"x": x})[0]
    np.testing.assert_allclose(got, np.stack([want.real, want.imag], -1), rtol=1e-4, atol=1e-4)


def test_dft_rejects_bad_last_dim():
    x = RNG.standard_normal((1, 4, 3)).astype(np.float32)
    m = node_model("DFT", {"x": x}, axis=1, opset=17)
    with pytest.raises(Exception, match="1 or 2"):
        run_kiln(m, {"x": x})


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_with_window(onesided):
    inputs = {"signal": RNG.standard_normal((2, 64, 1)).astype(np.float32),
              "step": np.array(8, np.int64),
              "window": np.hanning(16).astype(np.float32)}
    _close(node_model("STFT", inputs, onesided=onesided, opset=17), inputs)


def test_stft_frame_length_complex():
    x = RNG.standard_normal((1, 40, 2)).astype(np.float32)
    inputs = {"signal": x, "step": np.array(5, np.int64)}
    node = helper.make_node("STFT", ["signal", "step", "", "fl"], ["y0"], onesided=0)
    m = helper.make_model(helper.make_graph(
        [node], "t", [helper.make_tensor_value_info("signal", TensorProto.FLOAT, x.shape),
                      helper.make_tensor_value_info("step", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array(10, np.int64), "fl")]),
        opset_imports=[helper.make_opsetid("", 17)])
    c = x[0, :, 0] + 1j * x[0, :, 1]
    want = np.fft.fft(np.stack([c[i:i + 10] for i in range(0, 31, 5)]), axis=-1)
    got = run_kiln(m, inputs)[0]
    np.testing.assert_allclose(got[0], np.stack([want.real, want.imag], -1), atol=1e-4)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_windows(op, periodic, dtype):
    inputs = {"size": np.array(11, np.int64)}
    m = node_model(op, inputs, periodic=periodic, output_datatype=dtype, opset=17)
    _close(m, inputs, atol=1e-6)


def test_mel_weight_matrix():
    inputs = {"bins": np.array(8, np.int64), "dft": np.array(64, np.int64),
              "rate": np.array(8000, np.int64), "lo": np.array(0, np.float32),
              "hi": np.array(4000, np.float32)}
    check_against_reference(node_model("MelWeightMatrix", inputs, opset=17), inputs)
