"""GPT-2-style causal decoder (pre-LayerNorm, learned positions, tied LM head) in plain torch.

Defaults are GPT-2 small: 12 layers, 768 hidden, 12 heads, vocab 50257, 1024 positions.
The graph input is ``input_ids`` [batch, seq]; the output is ``logits`` [batch, seq, vocab].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kiln.zoo.bert import merge_heads

INPUT_NAMES = ["input_ids"]
OUTPUT_NAMES = ["logits"]
DYNAMIC_AXES = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
MASK_VALUE = -10000.0


@dataclass(frozen=True)
class GPT2Config:
    """Hyper-parameters; the defaults are GPT-2 small (124M)."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    vocab: int = 50257
    max_positions: int = 1024
    eps: float = 1e-5



class CausalSelfAttention(nn.Module):
    """Fused QKV projection, causal softmax attention, output projection."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden)
        causal = torch.tril(torch.ones(cfg.max_positions, cfg.max_positions, dtype=torch.bool))
        self.register_buffer("bias", causal[None, None], persistent=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        q, k, v = (self._split(t) for t in self.c_attn(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = self.bias[:, :, :seq, :seq]
        scores = torch.where(causal, scores, torch.tensor(MASK_VALUE, dtype=scores.dtype))
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.c_proj(merge_heads(ctx, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm decoder block."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """input_ids int64 [batch, seq] -> logits float32 [batch, seq, vocab]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.register_buffer("head_bias", torch.zeros(cfg.vocab), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe.weight[: input_ids.shape[1]]
        for block in self.h:
            x = block(x)
        return self._lm_head(self.ln_f(x))

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the tied token embedding. Written as a 2-D linear so that the export is
        a ``Gemm(transB=1)`` sharing the embedding initializer (no transposed weight copy)."""
        flat = nn.functional.linear(x.reshape(-1, x.shape[-1]), self.wte.weight, self.head_bias)
        return flat.view(x.shape[0], x.shape[1], self.config.vocab)


def _init_weights(model: GPT2) -> None:
    """GPT-2 init (N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)), with
    small non-zero biases and LayerNorm affine parameters."""
    proj_std = 0.02 / math.sqrt(2 * model.config.layers)
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            std = proj_std if name.endswith("c_proj") else 0.02
            nn.init.normal_(m.weight, 0.0, std)
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.bias, 0.0, 0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, 0.1)
            nn.init.normal_(m.bias, 0.0, 0.1)


def build(**opts: object) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a seeded, randomly initialised GPT-2 (``opts`` override :class:`GPT2Config`)."""
    cfg = GPT2Config(**opts)
    model = GPT2(cfg)
    _init_weights(model)
    return model.eval(), (torch.randint(0, cfg.vocab, (2, 8)),)


def sample_inputs(batch: int, seq: int, rng: np.random.Generator, vocab: int = 50257,
                  **_: object) -> dict:
    """Random token ids in [0, vocab)."""
    return {"input_ids": rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)}
