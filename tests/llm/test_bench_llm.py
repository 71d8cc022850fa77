"""bench.llm writes its CUDA rows to the json as each one finishes."""

import json

from bench.llm import Rows


def test_rows_written_as_each_finishes(tmp_path):
    path = tmp_path / "llm.json"
    rows = Rows(str(path))
    row = {"row": "kiln", "decode_b1_tok_s": 1.0}
    rows.emit(row)
    assert json.loads(path.read_text()) == [row]
    row["throughput_256_tok_s"] = 2.0  # a row completed later is rewritten, not repeated
    rows.emit(row)
    rows.emit({"row": "transformers eager"})
    got = json.loads(path.read_text())
    assert [r["row"] for r in got] == ["kiln", "transformers eager"]
    assert got[0]["throughput_256_tok_s"] == 2.0


def test_agreement_counts_prefixes():
    from bench.llm import agreement

    got = agreement([[1, 2, 3], [1, 9, 3], [7, 2, 3]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert got == {"equal_sequences": "1/3", "agreeing_prefix_tokens": "4/9",
                   "first_token_equal": "2/3"}


def test_kiln_greedy_is_per_prompt_in_order(tiny_dir):
    from bench.llm import kiln_greedy
    from kiln.llm import LLM, SamplingParams

    llm = LLM(tiny_dir, num_blocks=64)
    prompts = [[5, 6, 7, 8], [100, 200], [9] * 11]
    got = kiln_greedy(llm.engine, prompts, 4)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, p)]


def test_throughput_row_splits_the_time(tiny_dir, monkeypatch):
    import random

    import torch

    from bench.llm import throughput_256
    from kiln.llm import LLM

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    eng = LLM(tiny_dir, num_blocks=64, max_num_batched_tokens=64).engine
    row = throughput_256(eng, random.Random(0), n=6, in_len=20, out_len=5)
    assert row["throughput_256_tok_s"] > 0 and row["steps"] >= 5
    assert 0 < row["runner_s"] and row["host_s"] > 0
    assert 1 <= row["prefill_phase_steps"] < row["steps"]
    for phase in ("prefill", "decode"):
        t = row[f"{phase}_step_ms"]
        assert 0 < t["median"] <= t["max"] and 0 <= t["slow_steps"] < row["steps"]
    assert "execute" not in vars(eng.runner)  # the runner's own method again
    pre, dec = row["prefill_phase"], row["decode_phase"]
    assert pre["steps"] + dec["steps"] == row["steps"]
    assert pre["tokens"] + dec["tokens"] == 6 * 20 + 6 * 4  # prompts + the decode steps' tokens
    for s in (pre, dec):
        assert set(s["total_s"]) >= {"schedule", "launch", "sync", "emit"}
    assert eng.profile is None and eng.runner.profile is None


def test_token_times_streamer_sees_prompt_then_each_token():
    # the compiled peer's timing: transformers hands the prompt, then every new token
    import torch

    from bench.llm import _TokenTimes, hf_generate, hf_model
    from kiln.llm.config import ModelConfig
    from tests.llm.helpers import TINY, tiny_state_dict

    hf = hf_model(ModelConfig.from_hf(TINY), tiny_state_dict(TINY))
    st = _TokenTimes()
    hf_generate(hf, torch.tensor([[5, 6, 7]]), 4, streamer=st)
    assert len(st.times) == 1 + 4 and st.times == sorted(st.times)


def test_kv_cache_rows_side_by_side(monkeypatch):
    """--kv-cache-dtype auto,fp8: each weight format runs with both caches; an FP8-KV row is
    judged against its own weights' FP16-KV row and gets a side-by-side 'kv cache' row."""
    import argparse

    import bench.llm as bl
    from kiln.llm.config import ModelConfig

    calls = []

    def fake_row(name, row, cfg, sd, tok, args, weights, refs=None, kv="auto", ref_row="kiln"):
        calls.append((row, refs, ref_row))
        tps = {"auto": 100.0, "fp8": 150.0}[kv]
        return {"model": name, "row": row, "throughput_256_tok_s": tps, "kv_blocks": 10,
                "decode_b1_tok_s": 1.0}, [[len(calls)]]

    monkeypatch.setattr(bl, "kiln_cuda_row", fake_row)
    monkeypatch.setattr(bl, "free_cuda", lambda: None)
    monkeypatch.setattr(bl.ROWS, "path", None)
    args = argparse.Namespace(cuda_weights="dtype,fp8", kv_cache_dtype="auto,fp8", peers=0)
    rows = bl.cuda_model_rows("7b", "m", lambda: (None, {}), None, args)
    assert [r["row"] for r in rows] == ["kiln", "kiln kv-fp8", "kv cache fp16 vs fp8",
                                        "kiln fp8", "kiln fp8 kv-fp8", "kv cache fp16 vs fp8"]
    # references: none for the first row, then the FP16-KV row of the same weights
    assert calls == [("kiln", None, "kiln"), ("kiln kv-fp8", [[1]], "kiln"),
                     ("kiln fp8", [[1]], "kiln"), ("kiln fp8 kv-fp8", [[3]], "kiln fp8")]
    assert rows[1]["throughput_256_vs_fp16_kv"] == 1.5
    side = rows[2]
    assert side["throughput_256_tok_s"] == [100.0, 150.0]
    assert side["throughput_256_fp8_over_fp16"] == 1.5 and side["rows"] == ["kiln",
                                                                            "kiln kv-fp8"]
    cfg = ModelConfig(vocab_size=8, hidden_size=4096, intermediate_size=8, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=128)
    assert bl.kv_token_bytes(cfg) == 2 * bl.kv_token_bytes(cfg, "fp8") == 512 * 1024


def test_attention_bench_rows_under_the_interpreter():
    import os

    import pytest

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels: TRITON_INTERPRET=1 on the CPU")
    from bench.llm_attention import run

    rows = run(batch=2, ctx=40, heads=2, kv_heads=2, head_dim=16, kvs=("auto", "fp8"),
               tiles=(0, 32), iters=1, device="cpu", dot_tiles=(32,))
    assert [(r["kv_cache_dtype"], r["kernel"]) for r in rows] == [
        ("auto", "dot"), ("auto", "tile32"), ("auto", "dot32:4"), ("fp8", "dot"),
        ("fp8", "tile32"), ("fp8", "dot32:4")]
    assert rows[0]["max_diff_vs_fp16_dot"] == 0
    assert all(r["max_diff_vs_fp16_dot"] < 1e-5 for r in rows[1:3])
    assert all(0 < r["max_diff_vs_fp16_dot"] < 0.1 * r["ref_max"] for r in rows[3:])
    assert all(r["gb_s"] > 0 for r in rows)
    gqa = run(batch=1, ctx=16, heads=4, kv_heads=2, head_dim=16, kvs=("auto",), tiles=(32,),
              iters=1, device="cpu")
    assert "skipped" in gqa[0]
