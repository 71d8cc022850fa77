"""The bench suite runs and reports; nothing here asserts on speed."""

from __future__ import annotations

import contextlib
import io
import json
import time

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from bench import report
from bench.peers import Peer, Prepared, max_rel_err
from bench.run import QUICK, main, run_one
from bench.workloads import workloads

SYSTEMS = {"onnxruntime", "torch eager", "kiln"}
FAST = ["--warmup", "0", "--iterations", "2", "--duration", "0"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cpu.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--device", "cpu", "--quick", "--no-compile", "--markdown", "--json",
                   str(out), *FAST])
    return rc, buf.getvalue(), out


def test_bench_quick_json_has_every_system(quick_run):
    rc, _, out = quick_run
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True
    for key in ("date", "device", "machine", "versions", "rows", "memory_method", "tolerance"):
        assert key in result
    assert result["machine"]["loadavg_start"] is not None
    assert {"kiln", "torch", "onnxruntime", "onnx", "python"} <= set(result["versions"])
    rows = result["rows"]
    assert {r["system"] for r in rows} == SYSTEMS
    for r in rows:
        assert r["status"] == "ok", r
        fields = ["median_ms", "p90_ms", "items_per_s", "setup_s", "peak_mem_mib"]
        if r["kiln"]:  # the build is measured apart from the inference peak
            fields += ["build_s", "build_peak_mem_mib"]
            assert r["setup_s"] >= r["build_s"]
        else:
            assert "build_peak_mem_mib" not in r
        for field in fields:
            assert isinstance(r[field], (int, float)), (r["system"], field)
    assert "build peak" in result["memory_method"]
    assert [r["system"] for r in rows if r["reference"]] == ["onnxruntime"]
    assert all("kiln_speedup" in r for r in rows if not r["kiln"])


def test_bench_quick_markdown_table(quick_run):
    _, stdout, out = quick_run
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert lines[0] == "| " + " | ".join(report.COLUMNS) + " |"
    assert len(lines) == 2 + len(SYSTEMS)
    assert all(ln.count("|") == len(report.COLUMNS) + 1 for ln in lines)
    assert out.with_suffix(".md").read_text().count("\n|") == len(lines)


def _peer(outputs, name="broken"):
    def prepare(wl, device, tmp):
        return Prepared(lambda: outputs, lambda y: [np.asarray(y, np.float32)])
    return Peer(name, "fp32", prepare)


def test_bench_mismatch_is_reported_and_still_timed(tmp_path):
    wl = workloads("cpu", quick=True)[0]
    ref = [np.ones((2, 3), np.float32)]
    row, _ = run_one(_peer(np.full((2, 3), 1.01)), wl, "cpu", tmp_path, QUICK, ref)
    assert row["status"] == "mismatch"
    assert row["max_rel_err"] == pytest.approx(0.01, rel=1e-3)
    assert row["median_ms"] is not None
    assert "MISMATCH" in report.cells(row)[4]


def test_bench_failing_system_is_a_row(tmp_path):
    def prepare(wl, device, tmp):
        raise RuntimeError("no C++ compiler\nlong trace")

    wl = workloads("cpu", quick=True)[0]
    row, outs = run_one(Peer("torch.compile", "fp32", prepare), wl, "cpu", tmp_path, QUICK, None)
    assert outs is None
    assert (row["status"], row["reason"]) == ("failed", "RuntimeError: no C++ compiler")
    assert report.cells(row)[4] == "failed: RuntimeError: no C++ compiler"


def test_bench_build_memory_is_not_inference_memory(tmp_path):
    """A build step's memory shows as build_peak_mem_mib, not in the inference peak."""
    held = []

    def build(wl, device, tmp):
        big = np.ones(64 * 2**20, np.uint8)  # 64 MiB, touched
        time.sleep(0.05)  # long enough for the 5 ms sampler, where VmHWM cannot be reset
        held.append(int(big[::4096].sum()))
        return "built"

    peer = Peer("kiln", "fp32", _peer(np.ones((2, 3))).prepare, is_kiln=True, build=build)
    wl = workloads("cpu", quick=True)[0]
    row, _ = run_one(peer, wl, "cpu", tmp_path, QUICK, None)
    assert row["status"] == "ok" and row["note"] == "built"
    assert row["build_peak_mem_mib"] >= 60
    assert row["peak_mem_mib"] < 30
    cells = report.cells(row)
    assert cells[report.COLUMNS.index("build peak MiB")] == format(row["build_peak_mem_mib"], ".0f")


def test_bench_failing_build_is_a_row(tmp_path):
    def build(wl, device, tmp):
        raise RuntimeError("import failed")

    peer = Peer("kiln", "fp32", _peer(np.ones((2, 3))).prepare, is_kiln=True, build=build)
    wl = workloads("cpu", quick=True)[0]
    row, outs = run_one(peer, wl, "cpu", tmp_path, QUICK, None)
    assert outs is None
    assert (row["status"], row["reason"]) == ("failed", "RuntimeError: import failed")
    assert row["peak_mem_mib"] is None and "build_peak_mem_mib" not in row


def test_max_rel_err_shapes_and_nan():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert max_rel_err([a], [a]) == 0.0
    assert max_rel_err([a.T], [a]) == float("inf")
    assert max_rel_err([np.full_like(a, np.nan)], [a]) == float("inf")


def test_speedup_is_peer_over_kiln():
    rows = [{"key": "k", "system": "kiln", "kiln": True, "precision": "fp32", "median_ms": 2.0},
            {"key": "k", "system": "onnxruntime", "kiln": False, "precision": "fp32",
             "median_ms": 3.0}]
    report.add_speedups(rows)
    assert rows[1]["kiln_speedup"] == pytest.approx(1.5)
