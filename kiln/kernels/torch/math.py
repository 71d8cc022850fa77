"""PyTorch kernels: elementwise math."""

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.util import unsigned_safe
from kiln.ops import math as M


@register(M.Add)
@unsigned_safe
def add(n, a, b):
    return torch.add(a, b)


@register(M.Relu)
def relu(n, x):
    return torch.relu(x)


@register(M.Equal)
def equal(n, a, b):
    return torch.eq(a, b)
