"""A Llama-architecture decoder over a paged KV cache, in torch ops (CPU and CUDA).

One step runs a flat batch of tokens from many sequences (prefill chunks and decodes mixed)::

    ids[T] -> embed -> 30 x [ RMSNorm -> QKV (one GEMM) -> RoPE -> paged attention -> O
                              + residual -> RMSNorm -> gate|up (one GEMM) -> SiLU*mul -> down
                              + residual ] -> RMSNorm -> last rows -> LM head

Q/K/V and gate/up are concatenated at load so a layer is four GEMMs. The attention backend
(``attention.py``) writes the step's K/V into the cache and attends over each sequence's blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.llm.config import ModelConfig, rope_inv_freq


class Layer:
    __slots__ = ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down")

    def __init__(self, sd: dict, i: int, cfg: ModelConfig, device, dtype):
        def w(name):
            return sd[f"model.layers.{i}.{name}"].to(device=device, dtype=dtype)

        self.ln1 = w("input_layernorm.weight")
        self.ln2 = w("post_attention_layernorm.weight")
        self.qkv = torch.cat([w(f"self_attn.{p}_proj.weight") for p in "qkv"]).contiguous()
        self.qkv_bias = None
        if f"model.layers.{i}.self_attn.q_proj.bias" in sd:
            self.qkv_bias = torch.cat([w(f"self_attn.{p}_proj.bias") for p in "qkv"])
        self.o = w("self_attn.o_proj.weight").contiguous()
        self.gate_up = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).contiguous()
        self.down = w("mlp.down_proj.weight").contiguous()


class LlamaModel:
    """Weights on one device plus the step function. ``dtype`` float32 on CPU, float16 on CUDA."""

    def __init__(self, cfg: ModelConfig, sd: dict, device="cpu", dtype=torch.float32):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.embed = sd["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        self.lm_head = (self.embed if cfg.tie_embeddings
                        else sd["lm_head.weight"].to(device=device, dtype=dtype))
        self.norm = sd["model.norm.weight"].to(device=device, dtype=dtype)
        self.layers = [Layer(sd, i, cfg, device, dtype) for i in range(cfg.num_layers)]
        inv, mscale = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout
        self.cos = (emb.cos() * mscale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * mscale).to(device=device, dtype=dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn, meta,
                logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Logits [rows, vocab] (float32) for ``logits_rows`` of the step's ``ids``.

        ``attn(layer_index, q, k, v, meta)`` -> [T, heads * head_dim]; ``meta`` is the
        backend's per-step metadata (slots, block tables, lengths), built once per step.
        """
        cfg = self.cfg
        hd, h = cfg.head_dim, cfg.hidden_size
        t = ids.shape[0]
        x = F.embedding(ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        eps = cfg.rms_norm_eps
        for i, lay in enumerate(self.layers):
            y = F.rms_norm(x, (h,), lay.ln1, eps)
            qkv = F.linear(y, lay.qkv, lay.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rope(q.view(t, -1, hd), cos, sin)
            k = _rope(k.view(t, -1, hd), cos, sin)
            o = attn(i, q, k, v.view(t, -1, hd), meta)
            x = x + F.linear(o, lay.o)
            y = F.rms_norm(x, (h,), lay.ln2, eps)
            gu = F.linear(y, lay.gate_up)
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, lay.down)
        if logits_rows is not None:
            x = x[logits_rows]
        x = F.rms_norm(x, (h,), self.norm, eps)
        return F.linear(x, self.lm_head).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x*cos + rotate_half(x)*sin, rotate_half([a, b]) = [-b, a]
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin
