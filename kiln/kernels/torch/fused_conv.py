"""PyTorch kernels for fused ops (conv and gemm): FusedConv, FusedGemm, FusedMatMul.

Each kernel computes ``act(op(x, W) + bias + residual)``. The generic path runs the product
with PyTorch, then the residual add and the activation in place on the fresh result. A
FusedConv the layout pass marked ``layout="nhwc"`` runs instead as one oneDNN primitive with its
bias, residual add and activation as post-ops (``torch.ops.mkldnn._convolution_pointwise``, what
inductor emits on CPU), on channels-last activations; its weight is packed for oneDNN on the
first run and kept in the node's ``cache``, so the engine file still holds plain arrays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.kernels.torch.nn import conv as conv_reference
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N

_MAX_PACKED = 4  # packed weights kept per node, one per input shape


def _clip(y, a):
    return y.clamp_(a.alpha, a.beta)


# activation -> in-place PyTorch epilogue on a fresh tensor
_TORCH_ACT = {
    "": lambda y, a: y,
    "Relu": lambda y, a: y.relu_(),
    "Clip": _clip,
    "Sigmoid": lambda y, a: y.sigmoid_(),
    "Tanh": lambda y, a: y.tanh_(),
    "Silu": lambda y, a: F.silu(y, inplace=True),
    "Gelu": lambda y, a: F.gelu(y),
    "GeluTanh": lambda y, a: F.gelu(y, approximate="tanh"),
    "HardSwish": lambda y, a: F.hardswish(y, inplace=True),
    "LeakyRelu": lambda y, a: F.leaky_relu(y, a.alpha, inplace=True),
}

# activation -> oneDNN post-op: (attr, scalars(attrs), algorithm)
_ONEDNN_ACT = {
    "": ("none", lambda a: [], ""),
    "Relu": ("relu", lambda a: [], ""),
    "Clip": ("hardtanh", lambda a: [a.alpha, a.beta], ""),
    "Sigmoid": ("sigmoid", lambda a: [], ""),
    "Tanh": ("tanh", lambda a: [], ""),
    "Silu": ("swish", lambda a: [], ""),
    "Gelu": ("gelu", lambda a: [], "none"),
    "GeluTanh": ("gelu", lambda a: [], "tanh"),
    "HardSwish": ("hardswish", lambda a: [], ""),
    "LeakyRelu": ("leaky_relu", lambda a: [a.alpha], ""),
}

assert set(_TORCH_ACT) == set(FC.ACTIVATIONS) == set(_ONEDNN_ACT)


def epilogue(y, a, residual=None):
    """``act(y + residual)``, in place on ``y`` (a tensor the kernel itself just made)."""
    if residual is not None:
        y = y.add_(residual) if y.shape == torch.broadcast_shapes(y.shape, residual.shape) \
            else y + residual
    return _TORCH_ACT[a.activation](y, a)


def _onednn_ok(a, x, w) -> bool:
    return (a.layout == "nhwc" and x.dim() == 4 and x.dtype == torch.float32
            and w.dtype == torch.float32 and torch.backends.mkldnn.is_available())


def _geometry(n, x, w):
    """(padding, stride, dilation) for oneDNN, or None when the pads are asymmetric."""
    key = ("geo", tuple(x.shape[2:]), tuple(w.shape))
    if key not in n.cache:
        k, s, d, p = N.spatial_attrs(n.a, 2, list(w.shape[2:]))
        _, pb, pe = N.window_geometry(list(x.shape[2:]), k, s, d, p, n.a.auto_pad)
        n.cache[key] = (list(pb), list(s), list(d)) if pb == pe else None
    return n.cache[key]


def _packed(n, x, w, geo):
    """The weight reordered into oneDNN's blocked layout for this input shape, made once per
    node and shape (the blocking oneDNN picks can differ with the batch size; a weight packed
    for another shape would be reordered again on every call). A few shapes are kept."""
    if n.cache.get("w_src") is not w:
        n.cache["w_src"], n.cache["packed"] = w, {}
    packed, key = n.cache["packed"], tuple(x.shape)
    if key not in packed:
        if len(packed) >= _MAX_PACKED:
            del packed[next(iter(packed))]
        pad, stride, dil = geo
        packed[key] = torch.ops.mkldnn._reorder_convolution_weight(
            w.contiguous(), pad, stride, dil, n.a.group or 1, list(key))
    return packed[key]


def _conv_onednn(n, x, w, b, r, geo):
    a = n.a
    pad, stride, dil = geo
    attr, scalars, algo = _ONEDNN_ACT[a.activation]
    x = x.contiguous(memory_format=torch.channels_last)
    wp = _packed(n, x, w, geo)
    groups = a.group or 1
    if r is None:
        return torch.ops.mkldnn._convolution_pointwise(
            x, wp, b, pad, stride, dil, groups, attr, scalars(a), algo)
    r = r.contiguous(memory_format=torch.channels_last)
    # after a binary post-op oneDNN (through PyTorch) takes only relu; others run in place after
    unary = "relu" if a.activation == "Relu" else None
    y = torch.ops.mkldnn._convolution_pointwise.binary(
        x, r, wp, b, pad, stride, dil, groups, "add", None, unary, [], None)
    return y if unary or not a.activation else _TORCH_ACT[a.activation](y, a)


@register(FC.FusedConv)
def fused_conv(n, x, w, b=None, r=None):
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    if _onednn_ok(n.a, x, w):
        geo = _geometry(n, x, w)
        if geo is not None:  # the pass fuses only residuals of the output's own shape
            return _conv_onednn(n, x, w, b, r, geo)
    return epilogue(conv_reference(n, x, w, b), n.a, r)


def _transposed(n, w):
    """W^T, contiguous, made once per node: F.linear reads the weight as [out, in]."""
    if n.cache.get("wt_src") is not w:
        n.cache["wt"] = w.t().contiguous()
        n.cache["wt_src"] = w
    return n.cache["wt"]


@register(FC.FusedMatMul)
def fused_matmul(n, x, w, b=None, r=None):
    if w.dim() == 2 and x.dim() >= 2 and x.dtype.is_floating_point:
        y = F.linear(x, _transposed(n, w), b)
    else:
        y = torch.matmul(x, w)
        if b is not None:
            y = y.add_(b) if y.shape == torch.broadcast_shapes(y.shape, b.shape) else y + b
    return epilogue(y, n.a, r)


@register(FC.FusedGemm)
def fused_gemm(n, a_in, b_in, c=None, r=None):
    a = n.a
    x = a_in.t() if a.transA else a_in
    if c is not None and c.dim() == 1 and x.dtype.is_floating_point:
        wt = b_in if a.transB else _transposed(n, b_in)
        y = F.linear(x, wt, c)
    else:
        y = torch.matmul(x, b_in.t() if a.transB else b_in)
        if c is not None:
            y = y + c
    return epilogue(y, a, r)
