"""GPT-2-style ONNX decoders with ``past_key_values`` inputs, in the LLM runtime.

The ONNX file goes through kiln's normal frontend (``kiln.Builder``: parse, passes, lowering)
into an engine with symbolic batch and past dims. Its inputs are ``input_ids`` [batch, seq or
1], ``attention_mask`` [batch, past + seq], optionally ``position_ids``, and one key and one
value per layer (``past_{i}_key`` / ``past_key_values.{i}.key`` ...: [batch, heads, past,
head_dim]); its outputs ``logits`` and the ``present`` key/values, which the next step feeds back
as ``past``. The KV cache is the model's own (contiguous per request, concatenated inside the
graph), so ``OnnxModelRunner`` keeps each request's ``present`` tensors and runs the requests of a
step one after another; the scheduler, sampling, detokenization and the API are the ones
Llama models use. Prefix caching is off for these models (a cached block is no past tensor).

A ``tokenizer.json`` next to the ``.onnx`` is used when present; otherwise a word-level
placeholder (``t0 t1 ...``) stands in, and prompts are best given as token ids.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kiln.errors import KilnError, ModelLoadError
from kiln.llm.config import ModelConfig
from kiln.llm.sampling import Sampler
from kiln.llm.scheduler import SchedulerOutput

_PAST = re.compile(r"past(?:_key_values)?[._]?(\d+)[._](key|value)$")
_PRESENT = re.compile(r"present[._]?(\d+)[._](key|value)$")


def _pairs(names, pattern) -> list[tuple[str, str]]:
    found = {}
    for n in names:
        m = pattern.search(n)
        if m:
            found[(int(m.group(1)), m.group(2))] = n
    layers = sorted({i for i, _ in found})
    if layers != list(range(len(layers))) or any((i, kv) not in found
                                                 for i in layers for kv in ("key", "value")):
        return []
    return [(found[(i, "key")], found[(i, "value")]) for i in layers]


class OnnxDecoder:
    """The engine of a decoder ONNX file plus what the LLM runtime needs to know about it."""

    def __init__(self, path: str | Path, device: str = "cpu", max_position: int = 1024):
        import kiln

        self.path = Path(path)
        self.device, self.dtype = torch.device(device), torch.float32
        self.engine = kiln.Builder(kiln.BuilderConfig(device=device)).build(str(self.path))
        ins = {t.name: t for t in self.engine.inputs}
        outs = [t.name for t in self.engine.outputs]
        self.past = _pairs(ins, _PAST)
        self.present = _pairs(outs, _PRESENT)
        missing = [n for n in ("input_ids", "attention_mask") if n not in ins]
        if missing or not self.past or len(self.present) != len(self.past) \
                or "logits" not in outs:
            raise ModelLoadError(
                f"{self.path}: not a decoder with past_key_values (inputs {sorted(ins)}, outputs "
                f"{outs}); kiln.llm runs ONNX decoders with input_ids, attention_mask, "
                "past_<i>_key/value inputs and logits, present_<i>_key/value outputs")
        self.has_positions = "position_ids" in ins
        seq = ins["input_ids"].shape[1]
        self.one_token = seq == 1  # exported for decode only: a prompt goes in token by token
        k = ins[self.past[0][0]].shape
        heads, head_dim = k[1], k[3]
        logits = [t for t in self.engine.outputs if t.name == "logits"][0].shape
        vocab = logits[-1]
        if not all(isinstance(d, int) for d in (heads, head_dim, vocab)):
            raise ModelLoadError(f"{self.path}: the past heads, head dim and vocabulary must be "
                                 f"fixed dims (got {k} and logits {logits})")
        self.cfg = ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim,
                               intermediate_size=0, num_layers=len(self.past), num_heads=heads,
                               num_kv_heads=heads, head_dim=head_dim, max_position=max_position,
                               name=self.path.stem)

    def empty_past(self) -> list[np.ndarray]:
        c = self.cfg
        z = np.zeros((1, c.num_heads, 0, c.head_dim), np.float32)
        return [z] * (2 * c.num_layers)

    def run(self, ctx, ids: list[int], past: list[np.ndarray], start: int):
        """(logits of the last token [vocab], present) after ``ids`` at positions start.."""
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, start + len(ids)), np.int64)}
        if self.has_positions:
            feeds["position_ids"] = np.arange(start, start + len(ids), dtype=np.int64)[None]
        for (kn, vn), k, v in zip(self.past, past[0::2], past[1::2]):
            feeds[kn], feeds[vn] = k, v
        out = ctx.run(feeds)
        present = [np.ascontiguousarray(out[n]) for pair in self.present for n in pair]
        return np.asarray(out["logits"])[0, -1], present


class OnnxModelRunner:
    """``execute(SchedulerOutput)`` over an :class:`OnnxDecoder`: each request's present K/V
    kept between steps (its KV-cache blocks are only the scheduler's accounting)."""

    own_kv = True  # the engine turns prefix caching off

    def __init__(self, model: OnnxDecoder, num_blocks: int, block_size: int):
        self.model, self.num_blocks, self.block_size = model, num_blocks, block_size
        self.ctx = model.engine.create_context()
        self.sampler = Sampler("cpu")
        self.pasts: dict[str, tuple[int, list[np.ndarray]]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        rows, reqs = [], []
        for s in out.scheduled:
            req = s.request
            length, past = self.pasts.get(req.request_id, (0, None))
            if s.start == 0 or past is None:  # a new request, or recomputed after preemption
                length, past = 0, self.model.empty_past()
            if length != s.start:
                raise KilnError(f"request {req.request_id}: step starts at token {s.start} but "
                                f"its past holds {length} (prefix caching must be off)")
            ids = req.tokens(s.start, s.start + s.num_new_tokens)
            chunks = [[t] for t in ids] if self.model.one_token else [ids]
            for c in chunks:
                logits, past = self.model.run(self.ctx, c, past, length)
                length += len(c)
            self.pasts[req.request_id] = (length, past)
            if s.samples:
                rows.append(torch.from_numpy(np.array(logits, np.float32)))
                reqs.append(req)
        if not reqs:
            return {}
        tokens = self.sampler.sample(torch.stack(rows), reqs)
        return {r.request_id: t for r, t in zip(reqs, tokens)}

    def forget(self, request_id: str):
        self.pasts.pop(request_id, None)
        self.sampler.forget(request_id)


def load_onnx_decoder(path: Path, device: str):
    """(OnnxDecoder, Tokenizer, name) for an ONNX decoder file."""
    from kiln.llm import tokenizer as tk

    if device != "cpu":
        raise ModelLoadError(f"{path}: ONNX decoders run on the CPU in kiln.llm (asked: {device})")
    model = OnnxDecoder(path, device)
    if (path.parent / "tokenizer.json").exists():
        tok = tk.from_hf_dir(path.parent, (), None)
    else:
        tok = tk.word_level(model.cfg.vocab_size)
    return model, tok, path.stem
