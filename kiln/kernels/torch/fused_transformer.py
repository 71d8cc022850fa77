"""PyTorch kernels for the fused transformer ops."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from kiln.ir import REGISTRY
from kiln.kernels.registry import register, sdpa
from kiln.ops import fused_transformer as FT
from kiln.ops import math as M


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    # [B, S, H*D] -> [B, H, S, D] as a view: SDPA reads strided q/k/v without copies
    return x.unflatten(-1, (h, -1)).transpose(-3, -2)


def _causal_mask(sq: int, sk: int, like: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(sq, sk, dtype=torch.bool, device=like.device).tril()
    return torch.zeros(sq, sk, dtype=like.dtype, device=like.device).masked_fill(
        ~keep, float("-inf"))


@register(FT.Attention, makes_plan=sdpa)
def attention(n, q, k=None, v=None, mask=None):
    a = n.a
    if a.qkv_split:  # one merged projection's output: q, k and v as views of it
        q, k, v = q.split(list(a.qkv_split), dim=-1)
    if a.num_heads:
        q, k, v = _heads(q, a.num_heads), _heads(k, a.num_heads), _heads(v, a.num_heads)
    else:
        k = k.transpose(-1, -2)  # the matched MatMul read k already transposed
    causal = bool(a.causal)
    if causal and mask is not None:  # SDPA takes one or the other: fold causality in
        mask = mask + _causal_mask(q.shape[-2], k.shape[-2], q)
        causal = False
    if mask is not None and _widens(mask, q, k):
        y = _widened(q, k, v, mask, float(a.scale))
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           scale=float(a.scale))
    return y.transpose(-3, -2).flatten(-2) if a.num_heads else y


def _widens(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Does ``mask`` broadcast the scores [..., Sq, Sk] up (a dim of the scores that is 1 where
    the mask's is not)? The fusion takes a mask whose dims inference did not know; ONNX's Add
    then widens the scores, which SDPA refuses."""
    scores = (*q.shape[:-1], k.shape[-2])
    if mask.dim() > len(scores):
        return True
    return any(m != 1 and m != d for m, d in zip(mask.shape[::-1], scores[::-1]))


def _widened(q, k, v, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T scale + mask) v with ONNX broadcasting, a fully masked row zeros."""
    p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale + mask, dim=-1)
    return torch.matmul(torch.where(p.isnan(), 0.0, p), v)


# elementwise ops a FusedPointwise program may hold -> the torch function computing each
POINTWISE = {
    M.Add: torch.add, M.Sub: torch.sub, M.Mul: torch.mul, M.Div: torch.div,
    M.Relu: torch.relu, M.Sigmoid: torch.sigmoid, M.Tanh: torch.tanh, M.Erf: torch.erf,
    M.Exp: torch.exp, M.Neg: torch.neg, M.Abs: torch.abs, M.Sqrt: torch.sqrt,
    M.Reciprocal: torch.reciprocal,
    # the mask steps CUDA builds fuse (kiln.passes.fusion.pointwise.MASK)
    M.And: torch.logical_and, M.Or: torch.logical_or, M.Xor: torch.logical_xor,
    M.Not: torch.logical_not, M.Equal: torch.eq, M.Less: torch.lt, M.Greater: torch.gt,
    M.LessOrEqual: torch.le, M.GreaterOrEqual: torch.ge, M.Where: torch.where,
}


def _compile(program: str) -> list:
    steps = []
    for name, refs in json.loads(program):
        op = REGISTRY.get("", name)
        steps.append((POINTWISE[op], [(r[0] == "s", int(r[1:])) for r in refs]))
    return steps


@register(FT.FusedPointwise)
def fused_pointwise(n, *inputs):
    if "steps" not in n.cache:
        n.cache["steps"] = _compile(n.a.program)
    vals: list = []
    for fn, refs in n.cache["steps"]:
        vals.append(fn(*[vals[i] if is_step else inputs[i] for is_step, i in refs]))
    return vals[-1]
