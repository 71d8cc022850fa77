"""The minilm workload: real weights where the package is installed, random weights (named so)
where it is not, as on the GPU machine, or when asked for with ``--models minilm-random``."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest

from bench.workloads import workloads
from kiln.zoo import minilm

LABEL = "all-MiniLM-L6-v2"
FAST = ["--batches", "1", "--no-compile", "--warmup", "0", "--iterations", "2", "--duration", "0"]
needs_package = pytest.mark.skipif(not minilm.has_package(),
                                   reason=f"{minilm.PACKAGE} is not installed")


@pytest.fixture
def no_package(monkeypatch):
    """A machine without the weights package (and without tokenizers/safetensors)."""
    for name in (minilm.PACKAGE, "tokenizers", "safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)
    assert not minilm.has_package()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_minilm_workload_random_without_package(no_package, device):
    wls = workloads(device, ["minilm"])
    assert [w.batch for w in wls] == [1, 8]
    for w in wls:
        assert w.options == {"weights": "random"}
        assert w.name == f"{LABEL} (random weights) s128"
        assert w.key == f"minilm-weightsrandom-s128-b{w.batch}"


@needs_package
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_minilm_workload_real_with_package(device):
    (w,) = workloads(device, ["minilm"], batches=[1])
    assert w.options == {} and w.name == f"{LABEL} s128" and w.key == "minilm-s128-b1"


def test_minilm_random_variant_by_name():
    (w,) = workloads("cpu", ["minilm-random"], batches=[2], quick=True)
    assert (w.model, w.options, w.batch, w.seq) == ("minilm", {"weights": "random"}, 2, 16)
    assert w.name == f"{LABEL} (random weights) s16"
    with pytest.raises(SystemExit, match="minilm-random"):
        workloads("cpu", ["minilm-rand"])


def test_tiny_label_unchanged():
    (w,) = workloads("cpu", ["bert-base"], quick=True)
    assert w.name == "BERT-base (tiny) s16"


def run_bench(tmp_path, models: str) -> dict:
    pytest.importorskip("onnxruntime")
    from bench.run import main

    out = tmp_path / "cpu.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--device", "cpu", "--models", models, "--json", str(out), *FAST]) == 0
    return json.loads(out.read_text())


def test_bench_minilm_without_package(no_package, tmp_path, monkeypatch):
    """Export, kiln, onnxruntime and torch eager (bench.peers.build_module) all agree, so the
    torch module has the weights of the ONNX export."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    rows = run_bench(tmp_path, "minilm")["rows"]
    assert {r["system"] for r in rows} == {"kiln", "onnxruntime", "torch eager"}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["workload"] == f"{LABEL} (random weights) s128"
        assert r["options"] == {"weights": "random"} and r["max_rel_err"] <= 1e-3
