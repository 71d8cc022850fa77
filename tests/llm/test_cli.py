import json

from kiln.cli.main import main


def test_generate_cli(tiny_dir, capsys):
    rc = main(["generate", str(tiny_dir), "--prompt", "Hello", "--max-tokens", "5",
               "--num-blocks", "16", "--ignore-eos"])
    out = capsys.readouterr()
    assert rc == 0 and "[5 tokens in" in out.err and out.out.strip()


def test_generate_cli_reports_bad_model(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope.gguf"), "--prompt", "x"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_bench_llm_cli(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench-llm", str(tiny_dir), "--num-blocks", "64", "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--concurrency", "2",
               "--request-rate", "inf", "--slo-ttft", "100000", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r.get("concurrency", r.get("request_rate")) for r in rows] == [2, float("inf")]
    for r in rows:
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["total_output_tokens"] == 16 and r["goodput"] > 0
        assert r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0 and r["peak_memory_mib"] > 0
    assert "TTFT" in capsys.readouterr().out
