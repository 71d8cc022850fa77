"""PyTorch kernels for the fused transformer ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.ops import fused_transformer as FT


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    # [B, S, H*D] -> [B, H, S, D] as a view: SDPA reads strided q/k/v without copies
    return x.unflatten(-1, (h, -1)).transpose(-3, -2)


def _causal_mask(sq: int, sk: int, like: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(sq, sk, dtype=torch.bool, device=like.device).tril()
    return torch.zeros(sq, sk, dtype=like.dtype, device=like.device).masked_fill(
        ~keep, float("-inf"))


@register(FT.Attention)
def attention(n, q, k, v, mask=None):
    a = n.a
    if a.num_heads:
        q, k, v = _heads(q, a.num_heads), _heads(k, a.num_heads), _heads(v, a.num_heads)
    else:
        k = k.transpose(-1, -2)  # the matched MatMul read k already transposed
    causal = bool(a.causal)
    if causal and mask is not None:  # SDPA takes one or the other: fold causality in
        mask = mask + _causal_mask(q.shape[-2], k.shape[-2], q)
        causal = False
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                       scale=float(a.scale))
    return y.transpose(-3, -2).flatten(-2) if a.num_heads else y
