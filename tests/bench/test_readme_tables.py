"""bench.readme: which run the README shows, and what its section says."""

from __future__ import annotations

import json

import pytest

from bench import readme
from bench.workloads import DEFAULT_MODELS, LABELS


def _row(workload, system, median, *, kiln=False, status="ok", speedup=None, batch=1, err=1e-6):
    return {"workload": workload, "batch": batch, "system": system, "precision": "fp32",
            "status": status, "kiln": kiln, "median_ms": median, "kiln_speedup": speedup,
            "max_rel_err": err, "reason": "" if median else "no provider"}


def _result(date, models=DEFAULT_MODELS, complete=True, extra=()):
    rows = []
    for m in models:
        rows += [_row(LABELS[m], "kiln", 10.0, kiln=True),
                 _row(LABELS[m], "onnxruntime", 12.0, speedup=1.2)]
    return {"date": date, "device": "cpu", "command": "python -m bench.run --device cpu",
            "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None, "loadavg_start": "0 0 0"},
            "versions": {"kiln": "0.1.0", "torch": "2.13.0"}, "complete": complete,
            "tolerance": {"fp32": 1e-3, "fp16": 2e-2}, "rows": rows + list(extra)}


def _write(folder, name, result):
    (folder / f"{name}.json").write_text(json.dumps(result))
    (folder / f"{name}.md").write_text("full table\n")


def test_newest_run_skips_runs_missing_a_default_model(tmp_path):
    _write(tmp_path, "cpu-a", _result("2026-11-30T10:00:00+00:00"))
    _write(tmp_path, "cpu-b", _result("2026-11-30T11:00:00+00:00", models=DEFAULT_MODELS[:1]))
    _write(tmp_path, "cpu-c", _result("2026-11-30T09:00:00+00:00"))
    path, _ = readme.newest_run("cpu", tmp_path)
    assert path.name == "cpu-a.json"


def test_newest_run_none_without_results(tmp_path):
    assert readme.newest_run("cuda", tmp_path) is None
    assert "No full CUDA run" in readme.device_section("cuda", tmp_path, tmp_path)


def test_device_section_has_header_table_and_notes(tmp_path):
    bad = _row(LABELS["resnet50"], "torch.compile", 11.0, status="mismatch", speedup=1.1,
               err=5e-3)
    na = _row(LABELS["resnet50"], "tensorrt", None, status="n/a")
    _write(tmp_path, "cpu-x", _result("2026-11-30T10:00:00+00:00", complete=False,
                                      extra=[bad, na]))
    text = readme.device_section("cpu", tmp_path, tmp_path)
    assert "[every column](cpu-x.md)" in text
    assert "- command: `python -m bench.run --device cpu`" in text
    assert "Test CPU (2 cores)" in text and "torch 2.13.0" in text
    assert "| workload | batch | kiln ms | onnxruntime ms | torch.compile ms |" in text
    assert "| ResNet-50 | 1 | 10.00 | 12.00 (1.20x) | 11.00* (1.10x) |" in text
    assert "torch.compile 5.0e-03" in text
    assert "not in the table: tensorrt (n/a: no provider)" in text
    assert "stopped before it finished" in text


def test_replace_section_refuses_missing_or_doubled_markers():
    with pytest.raises(ValueError, match="bench-cpu:start"):
        readme.replace_section("no markers here", "bench-cpu", "x")
    twice = "<!-- a:start -->\n<!-- a:end -->\n<!-- a:start -->\n<!-- a:end -->"
    with pytest.raises(ValueError):
        readme.replace_section(twice, "a", "x")
    assert readme.replace_section("1 <!-- a:start -->old<!-- a:end --> 2", "a", "new") == \
        "1 <!-- a:start -->\nnew\n<!-- a:end --> 2"


def test_corpus_section_is_the_newest_corpus_table(tmp_path):
    assert "No corpus run" in readme.corpus_section(tmp_path, tmp_path)
    (tmp_path / "corpus-cpu-2026-12-01.md").write_text("| old |\n")
    (tmp_path / "corpus-cpu-2026-12-02.md").write_text("| new |\n")
    text = readme.corpus_section(tmp_path, tmp_path)
    assert "corpus-cpu-2026-12-02.md" in text and "| new |" in text and "old" not in text


def test_corpus_section_prefers_a_quiet_machines_run(tmp_path):
    """A newer whole-corpus run that started on a loaded machine (load >= half the cores)
    ranks below an older quiet one; a newer quiet run wins again."""
    head = ("**kiln corpus on cpu** ({stamp})\n\n"
            "`cmd` — 2 cores, load average {load} 1 1 at start\n\n")
    runs = {"corpus-cpu-2026-12-03.md": ("2026-12-03T14:00:00", "0.68", "| quiet |"),
            "corpus-cpu-2026-12-04-a.md": ("2026-12-04T20:00:00", "2.48", "| loaded |")}
    for name, (stamp, load, row) in runs.items():
        (tmp_path / name).write_text(head.format(stamp=stamp, load=load) + "- models: 46\n" + row)
    assert "| quiet |" in readme.corpus_section(tmp_path, tmp_path)
    (tmp_path / "corpus-cpu-2026-12-04-b.md").write_text(
        head.format(stamp="2026-12-04T21:40:00", load="0.40") + "- models: 46\n| later |")
    assert "| later |" in readme.corpus_section(tmp_path, tmp_path)


def test_update_and_check_round_trip(tmp_path):
    _write(tmp_path, "cpu-a", _result("2026-11-30T10:00:00+00:00"))
    page = tmp_path / "README.md"
    page.write_text("".join(f"<!-- {n}:start -->\n<!-- {n}:end -->\n"
                            for n in ("bench-cpu", "bench-cuda", "corpus-table")))
    args = ["--readme", str(page), "--results", str(tmp_path)]
    assert readme.main([*args, "--check"]) == 1
    assert readme.main(args) == 0
    assert readme.main([*args, "--check"]) == 0
    assert "| ResNet-50 | 1 | 10.00 |" in page.read_text()
