"""bench.llm_step: the physical bounds' arithmetic, and a smoke run of every part on a tiny
model (Triton's interpreter on the CPU)."""

import os

import pytest
import torch

from bench.llm_step import bound
from kiln.llm.config import ModelConfig

SEVEN_B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128)


def test_bound_matches_the_hand_counts():
    """7B shape, FP16 weights: the decode step at 256 x 640 over FP8 K/V is bench.llm's
    decode-phase limit (19.5k tok/s); the 256 x (512 / 256) run is ~11.9k tok/s prefill then
    decode, ~19.5k overlapped; FP16 K/V halves the tokens a step and caps the run at ~11.1k."""
    b = bound(SEVEN_B, 2, 1, 16, 512, 256, 640)
    step_bytes = SEVEN_B.weight_bytes(2) + 256 * 640 * 2 * 32 * 32 * 128
    assert b["decode_step_tok_s"] == pytest.approx(256 * 4.3e12 / step_bytes)
    gemm_flops = 2 * 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008) * 8192
    assert b["prefill_step_ms"] > gemm_flops / 790e12 * 1e3  # + the LM head and attention
    run = b["run_256x512/256"]
    assert 11_000 < run["serial_tok_s"] < 12_500 and 19_000 < run["overlapped_tok_s"] < 20_000
    fp16 = bound(SEVEN_B, 2, 2, 16, 512, 256, 640)["run_256x512/256"]
    assert fp16["overlapped_tok_s"] < 11_900 and fp16["serial_tok_s"] < run["serial_tok_s"]


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="no GPU and TRITON_INTERPRET is not 1")
def test_smoke_run_reports_every_part(tmp_path):
    import json

    from bench.llm_step import main

    path = tmp_path / "step.json"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = main(["--model", "tiny", "--device", dev, "--prompts", "2", "--prompt-len", "12",
                "--batch", "3", "--ctx", "20", "--engine-seqs", "3", "--engine-prompt", "8",
                "--engine-steps", "2", "--iters", "1", "--num-blocks", "64",
                "--max-model-len", "128", "--json", str(path)])
    assert json.loads(path.read_text())["model"] == "tiny"
    for part in ("prefill", "decode", "decode_b1", "engine_decode"):
        assert "error" not in res[part], res[part]
    assert res["prefill"]["tokens"] == 24 and res["prefill"]["step_ms_default"] > 0
    assert res["prefill"]["sdpa_batched_ms"] > 0 and res["decode"]["attention_ms"] > 0
    like = res["prefill"]["engine_like"]
    assert (like["decodes"], like["prompts"], like["chunk"]) == (1, 1, [6, 6])
    assert like["all_tokens"] == 1 + 12 + 6 and like["no_decodes_tokens"] == 18
    assert all(isinstance(like[f"{k}_ms"], float) for k in ("all", "no_chunk", "no_decodes"))
    assert res["engine_decode"]["steps"] == 2 and res["engine_decode"]["runner_ms"] > 0
    b1 = res["decode_b1"]
    assert set(b1["gemv"]) == {"qkv", "o", "gate_up", "silu_mul+down", "lm_head"}
    assert all(v["us"] > 0 and v["gb_s"] > 0 for v in b1["gemv"].values())
    assert set(b1["small_ms"]) == {"add_rms_norm", "rope_kv", "attention"}
    assert b1["step_ms"] > 0 and b1["bound_ms"] > 0
