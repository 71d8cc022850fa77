"""Generation end to end on a tiny random Llama (fast) against transformers' greedy generate."""

import pytest
import torch

from kiln.errors import KilnError
from kiln.llm import LLM, SamplingParams
from tests.llm.helpers import TINY, tiny_state_dict

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3, 4,", "def f(x):",
           "Once upon a time in a land far away, there lived a", "a", "Grüße 世界",
           "The quick brown fox jumps over the lazy dog. " * 4]


@pytest.fixture(scope="module")
def hf_tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    m.load_state_dict(tiny_state_dict(TINY), strict=False)
    m.tie_weights()
    return m


def hf_greedy(m, ids, n):
    with torch.inference_mode():
        t = torch.tensor([ids])
        out = m.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n,
                         eos_token_id=None, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("engine_args", [
    dict(num_blocks=64),
    dict(num_blocks=64, max_num_batched_tokens=7),  # chunked prefill, decodes beside it
    dict(num_blocks=12, block_size=8, enable_prefix_caching=False),  # preemption
    dict(num_blocks=64, native_decode=False),  # decode steps in torch ops, not kiln_llm_decode
], ids=["batch", "chunked", "preempt", "torch-decode"])
def test_greedy_matches_transformers(tiny_dir, hf_tiny, engine_args):
    llm = LLM(tiny_dir, **engine_args)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, p)
    for prompt, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_tiny, o.prompt_token_ids, 12), prompt
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)
    if "enable_prefix_caching" in engine_args:
        assert llm.engine.metrics.preemptions._value.get() > 0


def test_alone_equals_in_batch_and_prefix_cache_reuses(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=64)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batch = llm.generate(PROMPTS, p)
    for i in (0, 4, 7):
        alone = llm.generate([PROMPTS[i]], p)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
    again = llm.generate([PROMPTS[7]], p)[0]  # 45 prompt tokens: two blocks come from cache
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == batch[7].outputs[0].token_ids


def test_seeded_sampling_repeats_and_stops(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=64)
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    a = llm.generate(["Hello", "Hello"], [p, p])
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids
    greedy = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))[0].outputs[0]
    stop_id = greedy.token_ids[3]
    s = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0,
                                               stop_token_ids=[stop_id]))[0].outputs[0]
    assert s.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    assert s.finish_reason == "stop" and s.stop_reason == stop_id
    word = greedy.text[len(greedy.text) // 2:][:3]
    s = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, stop=[word],
                                               ignore_eos=True))[0].outputs[0]
    assert s.text == greedy.text[: greedy.text.index(word)] and s.stop_reason == word


def test_gguf_model_generates_like_hf_dir(tmp_path, tiny_dir, smollm2_metadata):
    from tests.llm.helpers import gguf_from_state_dict

    tok_md = {k: v for k, v in smollm2_metadata.items() if k.startswith("tokenizer.")}
    sd = tiny_state_dict(TINY)
    gguf_from_state_dict(tmp_path / "tiny.gguf", TINY, sd, tok_md, quant="q8_0")
    from kiln.llm.loader import load_weights

    _, deq = load_weights(tmp_path / "tiny.gguf")
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    hf.load_state_dict(deq, strict=False)
    hf.tie_weights()
    llm = LLM(tmp_path / "tiny.gguf", num_blocks=32)
    o = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0,
                                                                  ignore_eos=True))[0]
    assert o.outputs[0].token_ids == hf_greedy(hf, o.prompt_token_ids, 8)


def test_errors_are_clear(tiny_dir, tmp_path):
    llm = LLM(tiny_dir, num_blocks=4, block_size=4)
    with pytest.raises(KilnError, match="pool has 4"):
        llm.generate(["hello " * 10], SamplingParams(max_tokens=20))
    with pytest.raises(KilnError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(KilnError, match="config.json"):
        LLM(tmp_path)


def test_scheduler_limits_default_by_device(tiny_dir):
    """max_num_seqs / max_num_batched_tokens left at 0: 64 / 2048 on the CPU, 256 / 8192 on
    CUDA; given ones are kept; negative ones are an error naming both."""
    from kiln.llm.engine import EngineConfig, scheduler_limits

    assert scheduler_limits(EngineConfig(), "cpu") == (64, 2048)
    assert scheduler_limits(EngineConfig(), "cuda") == (256, 8192)
    assert scheduler_limits(EngineConfig(max_num_seqs=8), "cuda") == (8, 8192)
    assert scheduler_limits(EngineConfig(max_num_batched_tokens=96), "cpu") == (64, 96)
    with pytest.raises(KilnError, match="max_num_seqs=-1"):
        scheduler_limits(EngineConfig(max_num_seqs=-1), "cpu")
    eng = LLM(tiny_dir, num_blocks=64).engine
    assert (eng.scheduler.config.max_num_seqs,
            eng.scheduler.config.max_num_batched_tokens) == (64, 2048)
