"""bench/conformance.py: the skip files, the per-shard logs a crashed child leaves, the summary,
and one real run of two node cases on the CPU through worker processes."""

from __future__ import annotations

import json

from bench import conformance as C


def test_conformance_skips_cpu_and_cuda():
    cpu, cuda = C.skips_for("cpu"), C.skips_for("cuda")
    assert "test_bernoulli" in cpu and set(cpu) <= set(cuda)
    extra = set(cuda) - set(cpu)
    assert extra and all(cuda[k].startswith("CUDA: ") and len(cuda[k]) > 20 for k in extra)


def test_conformance_log_of_a_crashed_child(tmp_path):
    log = tmp_path / "shard.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [
        {"case": "a", "status": "start"}, {"case": "a", "status": "pass"},
        {"case": "b", "status": "start"}]) + "\n{truncated")
    done, started = C._read_log(log)
    assert set(done) == {"a"} and started == "b"  # b is the case that killed the child


def test_conformance_summary_groups_failures():
    res = {"a": {"case": "a", "status": "pass"},
           "b": {"case": "b", "status": "fail", "error": "KernelError: node 'X_1' failed"},
           "c": {"case": "c", "status": "fail", "error": "KernelError: node 'X_2' failed"},
           "d": {"case": "d", "status": "pass", "host": {"n": "ImageDecoder: PIL"}}}
    summary, md = C.summarize(res, {"s": "why"}, "cuda", 1.0)
    assert summary["pass_rate"] == 0.5 and summary["counts"] == {"pass": 2, "fail": 2}
    assert summary["declared_host_fallbacks"] == {"d": {"n": "ImageDecoder: PIL"}}
    assert "| 2: b, c | KernelError: node 'X_N' failed |" in md


def test_conformance_runs_cases_in_workers(tmp_path):
    rc = C.main(["--device", "cpu", "--workers", "2", "--out", str(tmp_path),
                 "--only", "^test_(relu|abs)$"])
    d = json.loads((tmp_path / "conformance_cpu.json").read_text())
    assert rc == 0 and set(d["cases"]) == {"test_relu", "test_abs"}
    assert all(r["status"] == "pass" for r in d["cases"].values())
