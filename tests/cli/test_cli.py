"""The kiln command, run as users run it: a real process on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.engine.models import mlp, mlp_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kiln_cmd(*args, check=True):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"kiln {' '.join(map(str, args))} failed:\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model = mlp(d / "mlp.onnx")
    # --no-optimize keeps the four layers by name, so the tests below can name them
    kiln_cmd("build", d / "mlp.onnx", "-o", d / "mlp.kiln", "--min-shapes", "x:1x8",
             "--opt-shapes", "x:4x8", "--max-shapes", "x:16x8", "--no-optimize")
    return d, model


def test_cli_build_prints_summary(tmp_path):
    mlp(tmp_path / "m.onnx")
    p = kiln_cmd("build", tmp_path / "m.onnx", "--verbose")
    assert (tmp_path / "m.kiln").exists()
    assert "4 nodes" in p.stdout and "wrote" in p.stdout and "MatMul" in p.stdout
    assert "[1/2] building" in p.stderr
    # the optimizer names what it merged: fc1's MatMul, its bias Add and the Relu
    assert "fc1" in p.stdout and "bias1" in p.stdout and "relu1" in p.stdout


def test_cli_build_notes_dynamic_inputs_without_a_profile(tmp_path):
    """A model with a symbolic batch dim, built without --shapes: the build says so (without
    --verbose), on a line of its own, with the --shapes to pass; with --shapes it does not."""
    mlp(tmp_path / "m.onnx")
    p = kiln_cmd("build", tmp_path / "m.onnx")
    note = [ln for ln in p.stdout.splitlines() if ln.startswith("note: dynamic inputs")]
    assert len(note) == 1 and "'x' [batch, 8]" in note[0] and "--shapes x:<batch>x8" in note[0]
    assert "[1/2] building" in p.stderr and "done" in p.stderr.splitlines()[-2]
    p = kiln_cmd("build", tmp_path / "m.onnx", "--shapes", "x:2x8", "-o", tmp_path / "f.kiln")
    assert "note: dynamic inputs" not in p.stdout


def test_cli_run_saves_outputs(files, tmp_path):
    d, model = files
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    p = kiln_cmd("run", d / "mlp.kiln", "--input", f"x:{tmp_path / 'x.npy'}", "--output-dir",
                 tmp_path / "out")
    assert "output y" in p.stdout and "3x4" in p.stdout
    np.testing.assert_allclose(np.load(tmp_path / "out" / "y.npy"), mlp_reference(x, model),
                               rtol=1e-5, atol=1e-5)


def test_cli_run_random_inputs_use_profile_opt(files):
    d, _ = files
    p = kiln_cmd("run", d / "mlp.kiln")
    assert "4x8" in p.stdout


def test_cli_inspect_json(files):
    d, _ = files
    info = json.loads(kiln_cmd("inspect", d / "mlp.kiln", "--json").stdout)
    assert info["inputs"][0]["name"] == "x"
    assert info["inputs"][0]["profiles"] == ["1x8 .. 16x8"]
    assert {r["op"] for r in info["layers"]} >= {"MatMul", "Relu"}
    assert info["kiln_version"] and info["torch_version"]


def test_cli_inspect_onnx_and_text(files):
    d, _ = files
    p = kiln_cmd("inspect", d / "mlp.onnx")
    assert "input  x" in p.stdout and "float32[batch,8]" in p.stdout
    p = kiln_cmd("inspect", d / "mlp.kiln")
    assert "TorchMatMul" in p.stdout or "MatMul" in p.stdout


def test_cli_ops_markdown():
    p = kiln_cmd("ops", "--markdown")
    assert p.stdout.startswith("| op | domain |") and "| Relu | ai.onnx |" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["build", "missing.onnx"], "does not exist"),
    (["run", "missing.kiln"], "does not exist"),
    (["build", "{onnx}", "--shapes", "x:2by8"], "bad shape"),
    (["run", "{kiln}", "--shapes", "x:32x8"], "outside every optimization profile"),
    (["inspect", "{onnx_as_kiln}"], "not a kiln engine file"),
])
def test_cli_errors_are_one_line(files, args, message):
    d, _ = files
    (d / "fake.kiln").write_bytes((d / "mlp.onnx").read_bytes())
    args = [a.format(onnx=d / "mlp.onnx", kiln=d / "mlp.kiln", onnx_as_kiln=d / "fake.kiln")
            for a in args]
    p = kiln_cmd(*args, check=False)
    assert p.returncode != 0
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.count("kiln: error") == 1


def test_cli_bench_json_and_exports(files, tmp_path):
    d, _ = files
    p = kiln_cmd("bench", d / "mlp.kiln", "--warmup", "10", "--iterations", "5", "--duration",
                 "0.2", "--streams", "2", "--json", "--export-times", tmp_path / "t.json",
                 "--export-profile", tmp_path / "p.json", "--percentiles", "50,99")
    out = json.loads(p.stdout)
    assert out["queries"] >= 5 and out["streams"] == 2 and set(out["percentiles_ms"]) == {
        "p50", "p99"}
    assert out["items_per_query"] == 4  # the profile's opt batch
    times = json.loads((tmp_path / "t.json").read_text())
    assert len(times) == out["queries"] and {t["stream"] for t in times} == {0, 1}
    layers = json.loads((tmp_path / "p.json").read_text())
    assert {r["name"] for r in layers} == {"fc1", "bias1", "relu1", "fc2"}
    assert abs(sum(r["percent"] for r in layers) - 100) < 1e-6
    assert all(isinstance(r["tactic"], str) for r in layers)  # the CPU pick, '' where none


def test_cli_bench_text_and_profile(files):
    d, _ = files
    p = kiln_cmd("bench", d / "mlp.kiln", "--warmup", "0", "--iterations", "3", "--duration",
                 "0", "--dump-profile")
    assert "Performance summary" in p.stdout and "Per-layer profile" in p.stdout


def test_cli_bench_plot(files, tmp_path):
    d, _ = files
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p = kiln_cmd("bench", d / "mlp.kiln", "--plot", tmp_path / "x.png", check=False)
        assert p.returncode != 0 and "needs matplotlib" in p.stderr
        return
    kiln_cmd("bench", d / "mlp.kiln", "--warmup", "0", "--iterations", "3", "--duration", "0",
             "--plot", tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
