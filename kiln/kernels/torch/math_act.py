"""PyTorch kernels: activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.ops import math as M


@register(M.Relu)
def relu(n, x):
    return torch.relu(x)


@register(M.LeakyRelu)
def leaky_relu(n, x):
    return F.leaky_relu(x, n.a.alpha)


@register(M.PRelu)
def prelu(n, x, slope):
    # the slope broadcasts to X unidirectionally; torch's prelu wants a per-channel vector,
    # so use the elementwise form, which also covers integer inputs
    if x.dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return x  # never negative
    return torch.where(x < 0, x * slope, x).to(x.dtype)


@register(M.Elu)
def elu(n, x):
    return F.elu(x, n.a.alpha)


@register(M.Selu)
def selu(n, x):
    alpha, gamma = n.a.alpha, n.a.gamma
    return torch.where(x > 0, x * gamma, (torch.exp(x) - 1) * (alpha * gamma))


@register(M.Celu)
def celu(n, x):
    return F.celu(x, n.a.alpha)


@register(M.Sigmoid)
def sigmoid(n, x):
    return torch.sigmoid(x)


@register(M.HardSigmoid)
def hard_sigmoid(n, x):
    return torch.clamp(x * n.a.alpha + n.a.beta, 0, 1)


@register(M.HardSwish)
def hard_swish(n, x):
    return F.hardswish(x)


@register(M.Softplus)
def softplus(n, x):
    return F.softplus(x)


@register(M.Softsign)
def softsign(n, x):
    return F.softsign(x)


@register(M.ThresholdedRelu)
def thresholded_relu(n, x):
    return torch.where(x > n.a.alpha, x, torch.zeros_like(x))


@register(M.Shrink)
def shrink(n, x):
    lambd, bias = n.a.lambd, n.a.bias
    zero = torch.zeros_like(x)
    # computed in x's dtype: Shrink also accepts integer tensors
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, zero)).to(x.dtype)


@register(M.Gelu)
def gelu(n, x):
    return F.gelu(x, approximate="tanh" if n.a.approximate == "tanh" else "none")


@register(M.Mish)
def mish(n, x):
    return F.mish(x)


@register(M.Swish)
def swish(n, x):
    alpha = n.a.alpha
    return x * torch.sigmoid(x if alpha is None or alpha == 1.0 else x * alpha)

