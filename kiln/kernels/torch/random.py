"""PyTorch kernels: random number generators.

With a ``seed`` attribute a node draws from its own generator seeded once, so a fresh engine
reproduces the same stream; without one it uses torch's global generator.
"""

from __future__ import annotations

import torch

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.ops import random as R


def _generator(n) -> torch.Generator | None:
    if n.a.seed is None:
        return None
    gen = n.cache.get("gen")
    if gen is None:
        gen = n.cache["gen"] = torch.Generator().manual_seed(int(n.a.seed))
    return gen


def _dtype(n, like=None) -> torch.dtype:
    if n.a.dtype:
        return TORCH_DTYPE[DType(n.a.dtype)]
    return like.dtype if like is not None else torch.float32


def _uniform(n, shape, dtype):
    # draw in float32/64 and cast: torch's CPU rand lacks some dtypes (bf16 is fine, fp8 not)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    u = torch.rand(shape, generator=_generator(n), dtype=wide)
    return (u * (n.a.high - n.a.low) + n.a.low).to(dtype)


def _normal(n, shape, dtype):
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    z = torch.randn(shape, generator=_generator(n), dtype=wide)
    return (z * n.a.scale + n.a.mean).to(dtype)


@register(R.RandomUniform)
def random_uniform(n):
    return _uniform(n, tuple(n.a.shape), _dtype(n))


@register(R.RandomNormal)
def random_normal(n):
    return _normal(n, tuple(n.a.shape), _dtype(n))


@register(R.RandomUniformLike)
def random_uniform_like(n, x):
    return _uniform(n, tuple(x.shape), _dtype(n, x))


@register(R.RandomNormalLike)
def random_normal_like(n, x):
    return _normal(n, tuple(x.shape), _dtype(n, x))


@register(R.Bernoulli)
def bernoulli(n, p):
    wide = torch.float64 if p.dtype == torch.float64 else torch.float32
    return torch.bernoulli(p.to(wide), generator=_generator(n)).to(_dtype(n, p))


@register(R.Multinomial)
def multinomial(n, logits):
    """Samples class indices from unnormalized log-probabilities [batch, classes]."""
    probs = torch.softmax(logits.to(torch.float64), -1)
    draws = torch.multinomial(probs, n.a.sample_size, replacement=True,
                              generator=_generator(n))
    return draws.to(_dtype(n) if n.a.dtype else torch.int32)
