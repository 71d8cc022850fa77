"""kiln compare (exit status, per-output metrics, layer by layer) and kiln debug precision."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.builder import Builder, BuilderConfig
from kiln.cli.main import main as kiln_main
from kiln.compare import KilnRunner, OnnxruntimeRunner, ReferenceRunner, compare_layers, metrics
from kiln.compare.precision_search import parse_metric, score
from kiln.errors import KilnError

pytest.importorskip("onnxruntime")


def _mlp(path, scale=1.0):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32) * scale, "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                          [w1, w2])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def mlp(tmp_path):
    path = _mlp(tmp_path / "mlp.onnx")
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(3):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((4, 16))
                .astype(np.float32))
    return path, calib


def test_metrics_hand_computed():
    m = metrics("y", [1.0, 2.0, 2.0], [1.0, 2.0, 1.0], atol=0.0, rtol=0.5)
    assert (m.max_abs, m.max_rel, m.mean_abs) == (1.0, 1.0, pytest.approx(1 / 3))
    assert m.cosine == pytest.approx(7 / (3 * np.sqrt(6)))
    assert not m.passed
    assert metrics("y", [1.0, 2.0], [1.0, 2.0]).passed


def test_compare_fp32_engine_passes_against_both_references(mlp, tmp_path):
    path, _ = mlp
    Builder(BuilderConfig()).build(path).save(tmp_path / "a.kiln")
    for ref in ("onnxruntime", "reference", "kiln-fp32"):
        assert kiln_main(["compare", str(path), "--engine", str(tmp_path / "a.kiln"),
                          "--ref", ref]) == 0


def test_compare_int8_engine_fails_tight_tolerance_and_names_a_layer(mlp, tmp_path, capsys):
    path, calib = mlp
    e = Builder(BuilderConfig(int8=True, calib=str(calib))).build(path)
    e.save(tmp_path / "q.kiln")
    args = ["compare", str(path), "--engine", str(tmp_path / "q.kiln"), "--inputs", str(calib)]
    assert kiln_main(args + ["--atol", "1e-7", "--rtol", "0"]) == 1
    assert kiln_main(args + ["--atol", "y:10", "--rtol", "0"]) == 0
    assert kiln_main(args + ["--layerwise", "--cos-jump", "0.99999999"]) == 1
    out = capsys.readouterr().out
    assert "first layer below cosine 0.99999999: fc1" in out


def test_layerwise_uses_tensor_names_surviving_fusion(mlp):
    path, calib = mlp
    e = Builder(BuilderConfig()).build(path)
    feeds = {"x": np.ones((4, 16), np.float32)}
    for ref in (OnnxruntimeRunner(path), ReferenceRunner(path)):
        rows, first = compare_layers(KilnRunner(e), ref, feeds)
        assert first is None and {layer for layer, _ in rows} >= {"fc2"}


def test_parse_metric_and_score():
    assert parse_metric("cos>=0.999") == ("cos", ">=", 0.999)
    with pytest.raises(KilnError, match="bad --metric"):
        parse_metric("cosine 0.9")
    ref = [{"y": np.array([[1.0, 0.0], [0.0, 1.0]])}]
    got = [{"y": np.array([[1.0, 0.0], [1.0, 1.0]])}]
    assert score(got, ref, "cos") == pytest.approx((1 + 1 / np.sqrt(2)) / 2)
    assert score(got, ref, "max_abs") == 1.0


def test_debug_precision_prints_layer_precision(mlp, capsys):
    path, calib = mlp
    assert kiln_main(["debug", "precision", str(path), "--calib", str(calib),
                      "--metric", "cos>=0.9999999"]) == 0
    out = capsys.readouterr().out
    assert "--layer-precision '" in out and "fc" in out
    assert kiln_main(["debug", "precision", str(path), "--calib", str(calib),
                      "--metric", "cos>=0.5"]) == 0
    assert "every layer can run in INT8" in capsys.readouterr().out
