"""The model runner: one ``SchedulerOutput`` -> one forward pass -> a sampled token per request.

Owns the KV-cache tensor, sized from a block count or from a fraction of the device's memory,
in the model's dtype or (``kv_cache_dtype="fp8"``) in FP8 e4m3 with per-layer K/V scales
(``kv_quant.py``): one byte per element, so twice the blocks of FP16 in the same memory.
"""

from __future__ import annotations

import torch

from kiln.errors import KilnError
from kiln.llm import kv_quant
from kiln.llm.attention import TorchPagedAttention, build_meta
from kiln.llm.model import LlamaModel
from kiln.llm.sampling import Sampler
from kiln.llm.scheduler import SchedulerOutput


def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype | None = None
                       ) -> int:
    """Bytes of one block's K and V over all layers, in ``kv_dtype`` (default: the model's)."""
    c = model.cfg
    itemsize = (kv_dtype or model.dtype).itemsize
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * itemsize


def blocks_from_memory(model: LlamaModel, block_size: int, fraction: float,
                       kv_dtype: torch.dtype | None = None) -> int:
    """Blocks that fit in ``fraction`` of the device memory left after the weights (blocks of
    ``kv_dtype``, default the model's dtype: an FP8 cache fits twice the blocks of FP16)."""
    if not 0 < fraction <= 1:
        raise KilnError(f"gpu_memory_utilization={fraction}: must be in (0, 1]")
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        budget = free - (1 - fraction) * total
    else:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        # the host is shared with everything else: at most half of what is free, and 1 GiB
        budget = min(avail * 0.5, total * fraction, 1 << 30)
    per_block = kv_bytes_per_block(model, block_size, kv_dtype)
    n = int(budget // per_block)
    if n < 1:
        raise KilnError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB for blocks of "
                        f"{per_block / 2**20:.1f} MiB); raise the "
                        "memory fraction or give num_blocks")
    return n


class ModelRunner:
    profile = None  # a StepProfile (set by LLMEngine.set_profile) while steps are timed

    """``native_decode``: run steps made only of decodes as one native call
    (``LlamaModel.decode_native``) where the model allows it (not over an FP8 cache: the native
    stack reads float32 K/V). ``kv_cache_dtype``: ``auto`` (the model's dtype) or ``fp8``;
    ``calculate_kv_scales``: FP8 scales from the first step's K/V amax instead of 1.0."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 native_decode: bool = True, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False):
        c = model.cfg
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.kv_dtype = kv_quant.resolve(kv_cache_dtype, model.dtype)
        fp8_kv = self.kv_dtype == kv_quant.FP8
        self.native_decode = native_decode and model.native_decode_ok() and not fp8_kv
        self.cache = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads,
                                 c.head_dim, dtype=self.kv_dtype, device=model.device)
        self.kv_scales = (kv_quant.KVScales(c.num_layers, model.device, calculate_kv_scales)
                          if fp8_kv else None)
        self.attn = self._make_attention()
        self.sampler = Sampler(model.device)

    def _make_attention(self):
        return TorchPagedAttention(self.cache, self.model.cfg.num_heads, self.kv_scales)

    def describe_kv(self) -> dict:
        """The cache's dtype and, for FP8, the range of its scales."""
        d = {"kv_cache_dtype": str(self.kv_dtype).replace("torch.", "")}
        if self.kv_scales is not None:
            d.update(self.kv_scales.describe())
        return d

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run the step; return {request_id: token} for the requests that sample this step."""
        if out.empty:
            return {}
        ids, positions, entries, rows, sampling = [], [], [], [], []
        t = 0
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            if n == 1:  # a decode (or a one-token chunk): no list slices
                ids.append(req.token_at(start))
                positions.append(start)
            else:
                ids += req.tokens(start, start + n)
                positions += range(start, start + n)
            entries.append((start, n, s.block_table))
            t += n
            if start + n == req.num_tokens:  # s.samples
                rows.append(t - 1)
                sampling.append(req)
        prof = self.profile
        if prof is not None:
            prof.mark("inputs")
            prof.device_start()
        tokens = self.forward_sample(ids, positions, entries, rows, sampling)
        if prof is not None:
            prof.mark("sync")
        return {r.request_id: tok for r, tok in zip(sampling, tokens)}

    def forward_sample(self, ids, positions, entries, rows, sampling) -> list[int]:
        """The step's forward pass and one sampled token per row of ``rows``."""
        logits = self.forward(ids, positions, entries, rows)
        self._launched()
        if not sampling:
            return []
        return self.sampler.sample(logits, sampling)

    def _launched(self):
        """The step's kernels are all launched: what follows waits for them (profiling)."""
        prof = self.profile
        if prof is not None:
            prof.device_end()
            prof.mark("launch")

    def forward(self, ids, positions, entries, rows) -> torch.Tensor:
        dev = self.model.device
        meta = build_meta(entries, self.block_size, dev)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        if self.native_decode and meta.max_q == 1 and len(rows) == len(entries):
            return self.model.decode_native(ids_t, pos_t, self.cache, meta)
        rows_t = torch.tensor(rows or [0], dtype=torch.long, device=dev)
        return self.model.forward(ids_t, pos_t, self.attn, meta, rows_t)

    def forget(self, request_id: str):
        self.sampler.forget(request_id)
