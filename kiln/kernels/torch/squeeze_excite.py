"""PyTorch kernel for kiln::SqueezeExcite: the whole block in one launch record (the mean, two
1x1 convolutions on a [N, C] vector, the gate and the scaling), instead of five or six layers.

On the CPU with kiln's C library, a float32 block runs on kiln's kernels (the pooling, two GEMMs
with the activation and a Sigmoid gate in their epilogues, the broadcast product), the weights
packed on the first run: the five torch ops cost five OpenMP regions and their Python, which on
MobileNetV3-Large's 14 x 14 blocks was most of the block's time. A native program plans the
block as the same records (kiln.engine.program_ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln import native
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


_NATIVE_ACTS = ("", "Relu", "Sigmoid", "Tanh", "Silu", "Gelu", "GeluTanh", "HardSwish")


def _native_ok(a, x, ws) -> bool:
    return (native.available and x.dim() == 4 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.numel() > 0 and a.activation in _NATIVE_ACTS
            and a.gate in ("Sigmoid", "HardSigmoid")
            and all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu")
                    for t in ws))


def _packed(n, w1, b1, w2, b2):
    """The two products bound to their packed weights, made once per node (the weights are
    constants: the same tensors every run)."""
    got = n.cache.get("se_native")
    if got is None or got[0] is not w1 or got[1] is not w2:
        a = n.a
        cr, c = w1.shape[0], w2.shape[0]
        bias = [None if b is None else b.reshape(-1).contiguous() for b in (b1, b2)]
        reduce = native.gemm_fn(native.PackedWeight(w1.reshape(cr, -1).t()), bias[0],
                                a.activation)
        expand = native.gemm_fn(native.PackedWeight(w2.reshape(c, -1).t()), bias[1],
                                "Sigmoid" if a.gate == "Sigmoid" else "")
        got = n.cache["se_native"] = (w1, w2, reduce, expand)
    return got[2], got[3]


def _native_se(n, x, w1, b1, w2, b2):
    a = n.a
    nb, c, h, w = x.shape
    reduce, expand = _packed(n, w1, b1, w2, b2)
    s = native.pool2d("avg", x, (h, w), (1, 1), (1, 1), (0, 0), (1, 1)).reshape(nb, c)
    hid = reduce(s, None, torch.empty((nb, w1.shape[0]), dtype=torch.float32))
    g = expand(hid, None, torch.empty((nb, c), dtype=torch.float32))
    if a.gate == "HardSigmoid":
        native.pointwise("HardSigmoid", g, None, a.alpha, a.beta, out=g)
    y = torch.empty_like(x)  # (x's memory format)
    return native.pointwise("Mul", x, g.view(nb, c, 1, 1), out=y)


@register(FC.SqueezeExcite)
def squeeze_excite(n, x, w1, b1=None, w2=None, b2=None):
    a = n.a
    if w2 is not None and w1.dim() >= 2 and _native_ok(a, x, (w1, b1, w2, b2)):
        return _native_se(n, x, w1, b1, w2, b2)
    s = x.mean((2, 3))  # [N, C]
    h = epilogue(_small_linear(s, w1.flatten(1), b1), _Act(a.activation))
    g = _gate(_small_linear(h, w2.flatten(1), b2), a)
    return x * g[:, :, None, None]


# up to this many products, a GPU block's two GEMVs run as a broadcast product and a sum: no
# cuBLAS call, so an engine whose other layers need no cuBLAS never initialises it (~150 ms at
# a fresh process's first run on the H200: ``python -m bench.cold_parts``). Above it the block
# calls cuBLAS, which it does not declare (autotune.untuned_libraries): at such sizes the
# engine-wide library rule may drop tuned cuBLAS picks for no cold-start gain, at a cost within
# its margin
SMALL_PRODUCTS = 1 << 22


def _small_linear(s: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  small: bool | None = None) -> torch.Tensor:
    """``F.linear(s, w, b)``; on a GPU below SMALL_PRODUCTS (or ``small``) without cuBLAS."""
    if small is None:
        small = s.is_cuda and s.shape[0] * w.numel() <= SMALL_PRODUCTS
    if small:
        y = (s[:, None, :] * w).sum(-1)  # [N, 1, C] x [O, C] -> [N, O], summed in float32
        return y if b is None else y + b
    return F.linear(s, w, b)
