"""PyTorch kernel for kiln::SqueezeExcite: the whole block in one launch record (the mean, two
1x1 convolutions on a [N, C] vector, the gate and the scaling), instead of five or six layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.kernels.torch.fused_conv import epilogue
from kiln.ops import fused_conv as FC


def _gate(s: torch.Tensor, a) -> torch.Tensor:
    if a.gate == "HardSigmoid":  # max(0, min(1, alpha * s + beta))
        return s.mul_(a.alpha).add_(a.beta).clamp_(0.0, 1.0)
    return s.sigmoid_()


class _Act:  # the reduce conv's activation, in FusedConv's epilogue table (no parameters)
    def __init__(self, name: str):
        self.activation, self.alpha, self.beta = name, 0.0, 0.0


@register(FC.SqueezeExcite)
def squeeze_excite(n, x, w1, b1=None, w2=None, b2=None):
    a = n.a
    s = x.mean((2, 3))  # [N, C]
    h = epilogue(F.linear(s, w1.flatten(1), b1), _Act(a.activation))
    g = _gate(F.linear(h, w2.flatten(1), b2), a)
    return x * g[:, :, None, None]
