"""PyTorch kernels: normalizations, the softmax family, MatMul/Gemm/Einsum/Det."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kiln.kernels.registry import cublas, register
from kiln.kernels.torch import fused_conv as FCK
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.kernels.torch.util import unsigned_safe
from kiln.ops import nn as N
from kiln.ops.rules import norm_axis

_LOW = (torch.float16, torch.bfloat16)


def _stash(n, x):
    """The dtype to compute in: stash_type (float32 by default) for low-precision inputs."""
    st = getattr(n.a, "stash_type", 1)
    want = TORCH_DTYPE[N.stash_dtype(n.a, None)] if st not in (None, 0) else x.dtype
    # never compute a wider input in a narrower type
    if x.dtype == torch.float64 and want != torch.float64:
        return x.dtype
    return want


# ---------------------------------------------------------------- normalizations


@register(N.BatchNormalization)
def batch_norm(n, x, scale, bias, mean, var):
    a = n.a
    eps = a.epsilon if a.epsilon is not None else 1e-5
    xd = x.dtype
    sc, bi = scale.to(xd), bias.to(xd)
    if not a.training_mode:
        return F.batch_norm(x, mean.to(xd), var.to(xd), sc, bi, False, 0.0, eps)
    dims = [0] + list(range(2, x.dim()))
    cur_mean = x.mean(dim=dims)
    cur_var = x.var(dim=dims, unbiased=False)
    y = F.batch_norm(x, cur_mean, cur_var, sc, bi, False, 0.0, eps)
    mom = a.momentum if a.momentum is not None else 0.9
    run_mean = mean * mom + cur_mean.to(mean.dtype) * (1 - mom)
    run_var = var * mom + cur_var.to(var.dtype) * (1 - mom)
    return (y, run_mean, run_var)[:n.n_out]


@register(N.InstanceNormalization)
def instance_norm(n, x, scale, bias):
    eps = n.a.epsilon if n.a.epsilon is not None else 1e-5
    return F.instance_norm(x, weight=scale.to(x.dtype), bias=bias.to(x.dtype), eps=eps)


@register(N.LayerNormalization)
def layer_norm(n, x, scale, bias=None):
    a = n.a
    ax = norm_axis(a.axis if a.axis is not None else -1, x.dim())
    eps = a.epsilon if a.epsilon is not None else 1e-5
    cd = _stash(n, x)
    xc = x.to(cd)
    norm_shape = tuple(x.shape[ax:])
    if n.n_out == 1:
        if tuple(scale.shape) == norm_shape and (bias is None or bias.shape == scale.shape):
            y = F.layer_norm(xc, norm_shape, scale.to(cd),
                             None if bias is None else bias.to(cd), eps)
            return y.to(x.dtype)
        y = F.layer_norm(xc, norm_shape, None, None, eps)
        y = y * scale.to(cd)
        return (y if bias is None else y + bias.to(cd)).to(x.dtype)
    dims = tuple(range(ax, x.dim()))
    var, mean = torch.var_mean(xc, dim=dims, unbiased=False, keepdim=True)
    inv = torch.rsqrt(var + eps)
    y = (xc - mean) * inv * scale.to(cd)
    if bias is not None:
        y = y + bias.to(cd)
    sd = TORCH_DTYPE[N.stash_dtype(a, None)] if a.stash_type else x.dtype
    return (y.to(x.dtype), mean.to(sd), inv.to(sd))[:n.n_out]


@register(N.GroupNormalization)
def group_norm(n, x, scale, bias):
    a = n.a
    g = a.num_groups
    c = x.shape[1]
    eps = a.epsilon if a.epsilon is not None else 1e-5
    cd = _stash(n, x)
    if scale.numel() != c:  # opset 18: one scale/bias per group
        scale = scale.repeat_interleave(c // g)
        bias = bias.repeat_interleave(c // g)
    y = F.group_norm(x.to(cd), g, scale.to(cd), bias.to(cd), eps)
    return y.to(x.dtype)


@register(N.RMSNormalization)
def rms_norm(n, x, scale):
    a = n.a
    ax = norm_axis(a.axis if a.axis is not None else -1, x.dim())
    eps = a.epsilon if a.epsilon is not None else 1e-5
    cd = _stash(n, x)
    xc = x.to(cd)
    dims = tuple(range(ax, x.dim()))
    y = xc * torch.rsqrt(xc.pow(2).mean(dim=dims, keepdim=True) + eps)
    return (y * scale.to(cd)).to(x.dtype)


@register(N.LRN)
def lrn(n, x):
    a = n.a
    size = a.size
    alpha = a.alpha if a.alpha is not None else 1e-4
    beta = a.beta if a.beta is not None else 0.75
    bias = a.bias if a.bias is not None else 1.0
    # ONNX sums channels [c - floor((size-1)/2), c + ceil((size-1)/2)]: for even sizes that is
    # the mirror image of torch.local_response_norm's window, so do the sum directly
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = (x * x).reshape(x.shape[0], 1, x.shape[1], -1)
    sq = F.pad(sq, (0, 0, before, after))
    total = F.avg_pool2d(sq, (size, 1), stride=1) * size
    div = (bias + (alpha / size) * total).pow(beta)
    return x / div.reshape(x.shape)


@register(N.LpNormalization)
def lp_normalization(n, x):
    p = n.a.p if n.a.p is not None else 2
    ax = n.a.axis if n.a.axis is not None else -1
    norm = torch.linalg.vector_norm(x, ord=p, dim=ax, keepdim=True)
    # an all-zero slice stays zero (ONNX's reference), not 0/0
    return x / torch.where(norm == 0, torch.ones_like(norm), norm)


@register(N.MeanVarianceNormalization)
def mean_variance_normalization(n, x):
    axes = tuple(n.a.axes if n.a.axes is not None else (0, 2, 3))
    var, mean = torch.var_mean(x, dim=axes, unbiased=False, keepdim=True)
    # the ONNX function body divides by sqrt(var) + 1e-9
    return (x - mean) / (var.sqrt() + 1e-9)


# ---------------------------------------------------------------- softmax family


def _axis(n, x):
    return norm_axis(n.a.axis if n.a.axis is not None else -1, x.dim())


@register(N.Softmax)
def softmax(n, x):
    ax = _axis(n, x)
    if x.dtype == torch.float16:
        # rounding after each step, like ONNX's reference (and fp16 graphs that spell softmax
        # out): torch's fused half softmax rounds once and can differ by a couple of ulps
        e = torch.exp(x - x.amax(ax, keepdim=True))
        return e / e.sum(ax, keepdim=True)
    if ax == x.dim() - 1 and _native_softmax(x):
        from kiln import native

        return native.softmax_rows(x)
    return torch.softmax(x, ax)


NATIVE_SOFTMAX_MIN = 1 << 13  # elements below which torch's call (~1 us less) is the faster


def _native_softmax(x) -> bool:
    """Whether softmax.c takes a last-axis softmax of ``x``: float32 on the CPU, at least
    NATIVE_SOFTMAX_MIN elements, rows contiguous and evenly strided (one row stride for all
    the leading dims). torch's kernel runs its vectors along the row, slow on short ones:
    tv_ssdlite320's [1, 3234, 21] class scores 211 us at 1 thread against kiln's 50."""
    from kiln import native

    if not native.available or x.dtype != torch.float32 or x.device.type != "cpu" or \
            x.numel() < NATIVE_SOFTMAX_MIN or x.dim() < 2 or x.stride(-1) != 1:
        return False
    ld = x.stride(-2)
    if ld < x.shape[-1]:
        return False
    inner = ld * x.shape[-2]
    for d in range(x.dim() - 3, -1, -1):
        if x.shape[d] != 1 and x.stride(d) != inner:
            return False
        inner *= x.shape[d]
    return True


@register(N.LogSoftmax)
def log_softmax(n, x):
    return torch.log_softmax(x, _axis(n, x))


@register(N.Hardmax)
def hardmax(n, x):
    ax = _axis(n, x)
    if x.numel() == 0:
        return torch.zeros_like(x)
    idx = torch.argmax(x, dim=ax, keepdim=True)  # first maximum, as ONNX wants
    return torch.zeros_like(x).scatter_(ax, idx, 1)


# ---------------------------------------------------------------- matmul family


@register(N.MatMul, makes_plan=cublas)
@unsigned_safe
def matmul(n, a, b):
    return torch.matmul(a, b)


_NO_EPILOGUE = SimpleNamespace(activation="", alpha=0.0, beta=0.0)


@register(N.Gemm, makes_plan=cublas)
@unsigned_safe
def gemm(n, a, b, c=None):
    at = n.a
    alpha = at.alpha if at.alpha is not None else 1.0
    beta = at.beta if at.beta is not None else 1.0
    if (alpha == 1 and (c is None or beta == 1) and not n.cache.get("lin_dynamic")
            and a.dtype == torch.float32
            and b.dtype == torch.float32 and b.dim() == 2
            and (c is None or (c.dtype == torch.float32
                               and c.numel() in (1, b.shape[0 if at.transB else 1])
                               and (c.dim() < 2 or c.shape[0] == 1)))):
        # a float32 product with a weight: the CPU linear tactics (MKL / packed oneDNN)
        wt = b if at.transB else b.t()  # a view
        bias = None if c is None else c.reshape(-1).expand(wt.shape[0]).contiguous()
        return FCK.linear(n, a.t() if at.transA else a, wt, bias, _NO_EPILOGUE, src=b)
    if at.transA:
        a = a.t()
    if at.transB:
        b = b.t()
    if not a.dtype.is_floating_point:  # integer Gemm: keep exact integer arithmetic
        y = torch.matmul(a, b)
        y = y * int(alpha) if alpha != 1 else y
        if c is not None:
            y = y + (c * int(beta) if beta != 1 else c)
        return y.to(a.dtype)
    if c is None or beta == 0:
        y = torch.matmul(a, b)
        return y if alpha == 1 else y * alpha
    return torch.addmm(c.to(a.dtype), a, b, beta=beta, alpha=alpha)


@register(N.Einsum, makes_plan=cublas)
@unsigned_safe
def einsum(n, *xs):
    eq = n.a.equation.replace(" ", "")
    return torch.einsum(eq, *xs)


@register(N.Det)
def det(n, x):
    if x.dtype in _LOW:
        return torch.linalg.det(x.float()).to(x.dtype)
    return torch.linalg.det(x)

