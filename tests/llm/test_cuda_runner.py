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
