"""BERT encoder written in plain torch, with parameter names matching ``transformers.BertModel``.

Because the state-dict keys match Hugging Face's, real checkpoints (e.g. all-MiniLM-L6-v2, see
``kiln.zoo.minilm``) load straight into :class:`BertEncoder`, and ``transformers`` is not needed.
Token types are fixed to segment 0, so the graph inputs are ``input_ids`` and ``attention_mask``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

INPUT_NAMES = ["input_ids", "attention_mask"]
OUTPUT_NAMES = ["last_hidden_state"]
DYNAMIC_AXES = {
    "input_ids": {0: "batch", 1: "seq"},
    "attention_mask": {0: "batch", 1: "seq"},
    "last_hidden_state": {0: "batch", 1: "seq"},
}
MASK_VALUE = -10000.0  # additive mask for padded keys; finite, and representable in fp16


@dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters; the defaults are BERT-base (uncased)."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    eps: float = 1e-12



def merge_heads(ctx: torch.Tensor, hidden: int) -> torch.Tensor:
    """[batch, heads, seq, head_dim] -> [batch, seq, hidden]."""
    return ctx.transpose(1, 2).reshape(ctx.shape[0], -1, hidden)


class Embeddings(nn.Module):
    """Word + learned position + (segment 0) token-type embeddings, then LayerNorm."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:seq]
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention projections (``attention.self``)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask_bias
        ctx = torch.softmax(scores, dim=-1) @ v
        return merge_heads(ctx, self.heads * self.head_dim)


class AttentionOutput(nn.Module):
    """Output projection + residual + LayerNorm (also used for the FFN output)."""

    def __init__(self, cin: int, hidden: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(cin, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = AttentionOutput(cfg.hidden, cfg.hidden, cfg.eps)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask_bias), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.intermediate)
        self.act = nn.GELU()  # exact (erf) GELU, as in BERT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    """One post-LayerNorm transformer encoder layer."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = AttentionOutput(cfg.intermediate, cfg.hidden, cfg.eps)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask_bias)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask_bias)
        return x


class BertEncoder(nn.Module):
    """(input_ids, attention_mask) int64 [batch, seq] -> last_hidden_state [batch, seq, hidden]."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask[:, None, None, :].to(torch.float32)
        mask_bias = (1.0 - keep) * MASK_VALUE
        return self.encoder(self.embeddings(input_ids), mask_bias)


def _init_weights(model: nn.Module) -> None:
    """BERT-style N(0, 0.02) weights; small non-zero biases and LayerNorm affine so that
    a kernel that drops a bias or a LayerNorm parameter is caught."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.bias, 0.0, 0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, 0.1)
            nn.init.normal_(m.bias, 0.0, 0.1)


def example_inputs(cfg: BertConfig, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
    """Tracing inputs for export."""
    ids = torch.randint(0, cfg.vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[1:, seq // 2:] = 0
    return ids, mask


def build(**opts: object) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a seeded, randomly initialised BERT (``opts`` override :class:`BertConfig`)."""
    cfg = BertConfig(**opts)
    model = BertEncoder(cfg)
    _init_weights(model)
    return model.eval(), example_inputs(cfg)


def padded_mask(batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [batch, seq] mask: row 0 is full, other rows keep a random prefix of >= seq/2."""
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(1, batch):
        mask[row, int(rng.integers(max(seq // 2, 1), seq + 1)):] = 0
    return mask


def sample_inputs(batch: int, seq: int, rng: np.random.Generator, vocab: int = 30522,
                  **_: object) -> dict:
    """Random ids in [1000, vocab) framed by [CLS]/[SEP], 0-padded where the mask is 0."""
    mask = padded_mask(batch, seq, rng)
    ids = rng.integers(min(1000, vocab - 1), vocab, size=(batch, seq), dtype=np.int64)
    ids[:, 0] = min(101, vocab - 1)
    lengths = mask.sum(axis=1)
    ids[np.arange(batch), lengths - 1] = min(102, vocab - 1)
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}
