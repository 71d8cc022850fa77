"""Paged attention over the KV cache in torch ops (the CPU path; CUDA prefill uses it too).

Cache: ``[layers, 2, blocks, block_size, kv_heads, head_dim]``. A step's metadata, built once and
shared by every layer: the slot of each new token, each sequence's block table (padded), its
query rows and its context length. Per layer: write the new K/V into their slots, gather each
sequence's blocks (whole blocks, one index per block), and run SDPA with GQA; a mask hides the
padding and makes a query at position p see keys 0..p.

An FP8 cache (``kv_cache_dtype="fp8"``, ``kv_quant.py``) is written quantized with the layer's
scales and read back dequantized to the queries' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.llm import kv_quant


@dataclass
class AttnMeta:
    slots: torch.Tensor  # [T] flat slot of each new token
    tables: torch.Tensor  # [B, max_blocks] block ids (padding: block 0, masked)
    mask: torch.Tensor | None  # [B, 1, max_q, max_blocks * block_size] True = attend
    pad_rows: torch.Tensor | None  # [B * max_q] row of q (T = a zero row) for each padded slot
    unpad_rows: torch.Tensor | None  # [T] padded row of each token
    batch: int
    max_q: int
    max_ctx: int  # the longest context, in tokens (= the keys of a single sequence)
    context_lens: torch.Tensor | None = None  # [B] int32 (decode kernels)
    query_lens: list[int] | None = None


def build_meta(entries, block_size: int, device) -> AttnMeta:
    """``entries``: (start, num_new, block_table) per sequence, in the step's token order."""
    qlens = [n for _, n, _ in entries]
    ctx = [s + n for s, n, _ in entries]
    b, max_q, max_ctx = len(entries), max(qlens), max(ctx)
    nb = -(-max_ctx // block_size)
    # slots and padded tables in Python lists, one tensor each (a decode step has one token
    # per sequence: per-sequence tensor ops cost more than the step's attention)
    slots = [table[p // block_size] * block_size + p % block_size
             for start, n, table in entries for p in range(start, start + n)]
    slots = torch.tensor(slots, dtype=torch.long)
    tables = torch.tensor([list(table) + [0] * (nb - len(table)) for _, _, table in entries],
                          dtype=torch.long)
    mask = pad = unpad = None
    # one sequence, decoding or prefilling from position 0: slicing its keys + is_causal will do
    single = b == 1 and (max_q == 1 or qlens[0] == ctx[0])
    if not single:
        keys = torch.arange(nb * block_size)
        q_pos = torch.tensor([c - q for c, q in zip(ctx, qlens)]).view(b, 1) + torch.arange(max_q)
        mask = (keys.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, max_q, K]
    if any(q != max_q for q in qlens):
        t_total = sum(qlens)
        pad = torch.full((b, max_q), t_total, dtype=torch.long)
        off = 0
        for i, q in enumerate(qlens):
            pad[i, :q] = torch.arange(off, off + q)
            off += q
        pad = pad.view(-1)
        unpad = torch.cat([torch.arange(q) + i * max_q for i, q in enumerate(qlens)])
    dev = torch.device(device)
    return AttnMeta(slots.to(dev), tables.to(dev), None if mask is None else mask.to(dev),
                    None if pad is None else pad.to(dev),
                    None if unpad is None else unpad.to(dev), b, max_q, max_ctx,
                    torch.tensor(ctx, dtype=torch.int32, device=dev), qlens)


class TorchPagedAttention:
    """``attn(layer, q, k, v, meta)`` over a cache tensor, in torch ops."""

    def __init__(self, cache: torch.Tensor, num_heads: int,
                 scales: kv_quant.KVScales | None = None):
        self.cache = cache  # [L, 2, blocks, block_size, kv, hd]
        self.num_heads = num_heads
        _, _, self.num_blocks, self.block_size, self.kv_heads, self.head_dim = cache.shape
        self.fp8 = kv_quant.is_fp8(cache)
        if self.fp8 and scales is None:
            scales = kv_quant.KVScales(cache.shape[0], cache.device)
        self.scales = scales  # None for a cache in the model's dtype

    def k_scale(self, layer: int):
        return self.scales.k(layer) if self.fp8 else None

    def v_scale(self, layer: int):
        return self.scales.v(layer) if self.fp8 else None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta):
        kc = self.cache[layer, 0].view(-1, self.kv_heads, self.head_dim)
        vc = self.cache[layer, 1].view(-1, self.kv_heads, self.head_dim)
        if self.fp8:
            self.scales.before_write(layer, k, v)
        kv_quant.store(kc, meta.slots, k, self.k_scale(layer))
        kv_quant.store(vc, meta.slots, v, self.v_scale(layer))

    def __call__(self, layer: int, q, k, v, meta: AttnMeta) -> torch.Tensor:
        self.write(layer, k, v, meta)
        b, mq, hd = meta.batch, meta.max_q, self.head_dim
        # [B, blocks, bs, kv, hd] -> [B, kv, keys, hd]
        keys = kv_quant.load(self.cache[layer, 0], meta.tables, self.k_scale(layer), q.dtype)
        vals = kv_quant.load(self.cache[layer, 1], meta.tables, self.v_scale(layer), q.dtype)
        keys = keys.view(b, -1, self.kv_heads, hd).transpose(1, 2)
        vals = vals.view(b, -1, self.kv_heads, hd).transpose(1, 2)
        if meta.mask is None:  # one sequence whose keys are exactly its blocks
            keys, vals = keys[:, :, : meta.max_ctx], vals[:, :, : meta.max_ctx]
        if meta.pad_rows is not None:
            q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta.pad_rows]
        q = q.view(b, mq, -1, hd).transpose(1, 2)
        causal = meta.mask is None and mq > 1
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=meta.mask, is_causal=causal,
                                           enable_gqa=True)
        o = o.transpose(1, 2).reshape(b * mq, -1)
        if meta.unpad_rows is not None:
            o = o[meta.unpad_rows]
        return o
