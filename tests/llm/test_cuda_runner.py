"""The CUDA runner (FP16, Triton decode, CUDA graphs) against the CPU path: GPU only."""

import pytest
import torch

from kiln.llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3", "a b c d e f g h i j"]


@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_greedy_matches_cpu_fp32(tiny_dir, graphs):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    cpu = LLM(tiny_dir, num_blocks=64, device="cpu").generate(PROMPTS, p)
    gpu = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float32",
              cuda_graphs=graphs).generate(PROMPTS, p)
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_cuda_fp16_batch_equals_alone_with_graphs(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float16")
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batch = llm.generate(PROMPTS, p)
    alone = llm.generate([PROMPTS[2]], p)[0]
    assert alone.outputs[0].token_ids[:4] == batch[2].outputs[0].token_ids[:4]
    assert llm.engine.runner.graphs  # decode ran from captured graphs


@pytest.mark.parametrize("fused", ["0", "1"])
def test_cuda_fused_kernels_keep_cpu_tokens(tiny_dir, monkeypatch, fused):
    """FP32 on the GPU with the fused decode kernels on and off: the CPU's greedy tokens, in
    graphs, with a prompt arriving while others decode (a mixed step)."""
    monkeypatch.setenv("KILN_LLM_FUSED", fused)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    cpu = LLM(tiny_dir, num_blocks=64, device="cpu").generate(PROMPTS, p)
    llm = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float32", max_num_batched_tokens=8)
    gpu = llm.generate(PROMPTS, p)
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    want = {op: "triton" for op in ("add_rms_norm", "silu_mul", "rope_kv")} if fused == "1" \
        else "off"
    assert llm.engine.runner.describe()["fused"] == want


def test_cuda_fp8_runs_its_paths_and_stays_near_fp16(tiny_dir):
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fp16 = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float16").generate(PROMPTS, p)
    llm = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float16", weights="fp8",
              max_num_seqs=32)
    got = llm.generate(PROMPTS * 5, p)  # 20 rows: past the GEMV's 8, _scaled_mm in graphs
    first = [o.outputs[0].token_ids[0] for o in got[:len(PROMPTS)]]
    # e4m3 moves a tiny model's logits by ~10%: most first tokens agree (garbage: none would)
    assert sum(a == b.outputs[0].token_ids[0] for a, b in zip(first, fp16)) >= 2
    assert all(len(o.outputs[0].token_ids) == 8 for o in got)
    d = llm.engine.runner.describe()
    assert d["graphs"] and "error" not in d["gemv"], d
