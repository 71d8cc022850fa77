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


@pytest.mark.parametrize("calculate", [False, True])
def test_cuda_fp8_kv_cache_in_graphs_stays_near_fp16_kv(tiny_dir, calculate):
    """FP16 model, e4m3 KV cache (the fused RoPE + KV write quantizing, the Triton decode
    kernel reading FP8, CUDA graphs): greedy tokens near the FP16 cache's, twice its blocks
    from the same memory, no fallback taken."""
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    fp16 = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float16").generate(PROMPTS, p)
    llm = LLM(tiny_dir, num_blocks=64, device="cuda", dtype="float16", kv_cache_dtype="fp8",
              calculate_kv_scales=calculate, max_num_seqs=32)
    got = llm.generate(PROMPTS * 5, p)  # 20 rows: a larger graph
    first = [o.outputs[0].token_ids for o in got[:len(PROMPTS)]]
    want = [o.outputs[0].token_ids for o in fp16]
    # the first token comes from the prefill, which attends to the fresh FP16 K/V
    assert [a[0] for a in first] == [b[0] for b in want]
    if calculate:  # measured on the CPU torch path: 8 tokens each
        assert [a[:4] for a in first] == [b[:4] for b in want]
    assert all(len(o.outputs[0].token_ids) == 10 for o in got)
    d = llm.engine.runner.describe()
    assert d["graphs"] and d["decode"] == "cuda-graph", d
    assert d["kv_cache_dtype"] == "float8_e4m3fn" and d["fused"]["rope_kv"] == "triton", d
    assert d["calculated"] == calculate
    assert llm.engine.runner.cache.element_size() == 1


def test_cuda_fp8_kv_pool_is_twice_fp16():
    from kiln.llm import kv_quant
    from kiln.llm.runner import blocks_from_memory, kv_bytes_per_block
    from tests.llm.test_kv_fp8 import _model

    m = _model(torch.float16)
    m.device = torch.device("cuda")  # sizing only reads the device's free memory
    assert kv_bytes_per_block(m, 16, kv_quant.FP8) * 2 == kv_bytes_per_block(m, 16)
    n16 = blocks_from_memory(m, 16, 0.5)
    n8 = blocks_from_memory(m, 16, 0.5, kv_quant.FP8)
    assert abs(n8 - 2 * n16) <= 2 * max(1, n16 // 1000)  # free memory may move a little
