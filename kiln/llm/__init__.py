"""LLM generation: Llama-architecture decoders over a paged KV cache with continuous batching.

    from kiln.llm import LLM, SamplingParams
    llm = LLM("smollm2")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)
"""

from kiln.llm.engine import EngineConfig, LLMEngine
from kiln.llm.offline import LLM, CompletionOutput, RequestOutput
from kiln.llm.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LLMEngine",
           "EngineConfig"]
