"""PyTorch kernels for fused ops (conv and gemm): FusedConv, FusedGemm, FusedMatMul.

Each kernel computes ``act(op(x, W) + bias + residual)``. The generic path runs the product
with PyTorch, then the residual add and the activation in place on the fresh result. A
FusedConv the layout pass marked ``layout="nhwc"`` runs instead as one oneDNN primitive with its
bias, residual add and activation as post-ops (``torch.ops.mkldnn._convolution_pointwise``, what
inductor emits on CPU), on channels-last activations; its weight is packed for oneDNN on the
first run and kept in the node's ``cache``, so the engine file still holds plain arrays.

On CUDA, a 2-D FusedConv on FP16/BF16 activations runs channels-last (cuDNN's fast layout for
reduced precision): the weight is converted to ``torch.channels_last`` once per device and dtype
and kept in the node's ``cache``, the input is made channels-last only when it is not already (so
consecutive convolutions pass NHWC tensors along without copies), and the residual add and the
activation run in place on the conv's fresh NHWC output. ``CUDA_CHANNELS_LAST = False`` turns
that off (the NCHW path, for A/B checks). On CUDA, FusedMatMul/FusedGemm hand ``F.linear`` a
transposed *view* of the weight (cuBLAS reads either layout), never a transposed copy.

Float32 matrix products with a constant 2-D weight (FusedMatMul, FusedGemm, and plain Gemm
through :func:`linear`) pick a *tactic* per input shape on their first run: plain ``F.linear``
(MKL sgemm), MKL's packed GEMM (``torch.ops.mkl._mkl_linear``), oneDNN's inner product on a
weight reordered for it (``torch.ops.mkldnn._linear_pointwise``), that one also with the
activation or the residual add fused as a post-op, or kiln's own AVX2 GEMM (:mod:`kiln.native`)
with the bias, residual and activation applied to each tile in registers. The candidates are
timed against each other (interleaved, the fastest of several runs) and checked against
``F.linear``; the choice is kept per signature (input shape, weight shape, epilogue) for the
whole process, so the twelve identical layers of a transformer time once, and the packed weight
per node and input shape in the node's ``cache``. A weight wider than ``_SLICE_N`` output
features is timed on that many (each candidate packs a copy of what it is timed on).
``KILN_CPU_LINEAR=linear|mkl|onednn|onednn_fused|kiln`` pins one tactic.
"""


from __future__ import annotations

import math
import threading
import time

import torch
import torch.nn.functional as F

from kiln import native
from kiln.kernels.registry import cublas, cudnn, register
from kiln.kernels.torch.nn import conv as conv_reference
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N
from kiln.ops.rules import broadcast_ints
from kiln.runtime import host
from kiln.settings import SETTINGS

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
    "Gelu": lambda y, a: torch.ops.aten.gelu_(y),
    "GeluTanh": lambda y, a: torch.ops.aten.gelu_(y, approximate="tanh"),
    "HardSwish": lambda y, a: F.hardswish(y, inplace=True),
    "LeakyRelu": lambda y, a: F.leaky_relu(y, a.alpha, inplace=True),
    "HardSwishAffine": lambda y, a: F.hardswish(y, inplace=True).mul_(a.alpha).add_(a.beta),
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
    "HardSwishAffine": ("hardswish", lambda a: [], ""),  # then the scale and shift in torch
}
_AFTER_ONEDNN = {"HardSwishAffine": lambda y, a: y.mul_(a.alpha).add_(a.beta)}

assert set(_TORCH_ACT) == set(FC.ACTIVATIONS) == set(_ONEDNN_ACT)


def epilogue(y, a, residual=None):
    """``act(y + residual)``, in place on ``y`` (a tensor the kernel itself just made)."""
    if residual is not None:
        # in place when the residual broadcasts to y's shape as it is; checked here rather
        # than by torch.broadcast_shapes, whose first call imports torch._refs (~0.2 s)
        ys, rs = y.shape, residual.shape
        fits = len(rs) <= len(ys) and all(r in (1, s) for r, s in zip(reversed(rs), reversed(ys)))
        y = y.add_(residual) if fits else y + residual
    return _TORCH_ACT[a.activation](y, a)


def _onednn_ok(a, x, w) -> bool:
    return (a.layout == "nhwc" and x.dim() == 4 and x.dtype == torch.float32
            and x.device.type == "cpu"  # oneDNN is the CPU path; CUDA runs the generic one
            and w.dtype == torch.float32 and torch.backends.mkldnn.is_available())


def conv_window(n, x, w):
    """(output spatial dims, begin pads, end pads, strides, dilations) of a 2-D conv; kept per
    input and weight shape."""
    key = ("window", tuple(x.shape[2:]), tuple(w.shape))
    if key not in n.cache:
        k, s, d, p = N.spatial_attrs(n.a, 2, list(w.shape[2:]))
        outs, pb, pe = N.window_geometry(list(x.shape[2:]), k, s, d, p, n.a.auto_pad)
        n.cache[key] = (tuple(outs), list(pb), list(pe), list(s), list(d))
    return n.cache[key]


def symmetric_geometry(n, x, w):
    """(padding, stride, dilation, output spatial dims) of a 2-D conv, as oneDNN and cuDNN take
    them, or None when the pads are asymmetric."""
    outs, pb, pe, s, d = conv_window(n, x, w)
    return (pb, s, d, outs) if pb == pe else None


def _asymmetric(n, x, w):
    """(begin pads, strides, dilations, end pads) of a 2-D depthwise or one-group conv with
    asymmetric pads (kiln's depthwise and direct kernels take them; oneDNN here does not),
    else None."""
    depthwise = (n.a.group or 1) == x.shape[1] and w.shape[1] == 1 and w.shape[0] == x.shape[1]
    if not native.available or not (depthwise or ((n.a.group or 1) == 1
                                                  and w.shape[1] == x.shape[1])):
        return None
    _, pb, pe, s, d = conv_window(n, x, w)
    return (tuple(pb), tuple(s), tuple(d), tuple(pe))


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
        host.release_pages(w)  # not read again: its engine-file pages can go
    return packed[key]


def _conv_onednn(n, x, w, b, r, geo):
    a = n.a
    pad, stride, dil = geo
    attr, scalars, algo = _ONEDNN_ACT[a.activation]
    x = x.contiguous(memory_format=torch.channels_last)
    wp = _packed(n, x, w, geo)
    groups = a.group or 1
    if r is None:
        y = torch.ops.mkldnn._convolution_pointwise(
            x, wp, b, pad, stride, dil, groups, attr, scalars(a), algo)
        after = _AFTER_ONEDNN.get(a.activation)
        return y if after is None else after(y, a)
    r = r.contiguous(memory_format=torch.channels_last)
    # after a binary post-op oneDNN (through PyTorch) takes only relu; others run in place after
    unary = "relu" if a.activation == "Relu" else None
    y = torch.ops.mkldnn._convolution_pointwise.binary(
        x, r, wp, b, pad, stride, dil, groups, "add", None, unary, [], None)
    return y if unary or not a.activation else _TORCH_ACT[a.activation](y, a)


# ---------------------------------------------------------------- CPU conv tactics

# kiln: the kernel _kiln_conv picks for the conv's geometry; kiln_direct: kiln's direct conv
# (im2col + kiln's GEMM where the window is large), timed against Winograd for 3x3 stride-1
# convs (at 64 channels and 56x56 the GEMM's 576-long rows beat Winograd's 16 small GEMMs)
# and against the GEMM on a gathered copy for strided 1x1 ones (it gathers in blocks, in L2)
CONV_TACTICS = ("onednn", "kiln", "kiln_direct")
# What a kiln conv's timed call costs in Python (its wrapper's checks, the output tensor, the
# ctypes call: 6-7 us against 1.3 us for the kernel alone, a 4x4 depthwise conv on this VM)
# and a native program's record of it does not: the pick compares what a program would run
# (oneDNN's conv runs there as a torch record, its Python included)
PROGRAM_CREDIT_S = 5e-6
# The same for a GEMM whose rival is F.linear, which a program runs as a torch record: the
# record's own cost (back into Python, tensors viewing the program's memory, its result's
# address stored) comes on top of the timed call's. A 1 x 256 x 688 product (a Llama decode
# step's MLP) timed 11-13 us under either tactic here, and the pick flipped from build to build
LINEAR_PROGRAM_CREDIT_S = 2 * PROGRAM_CREDIT_S
_FORCED_CONV = SETTINGS.cpu_conv  # a forced conv tactic, for repeatable measurements
# oneDNN's conv (OpenMP threads, passive: asleep until the region) run right after a kiln
# kernel found kiln's workers spinning (up to 0.1 ms, team.c) on the cores its threads wanted:
# a 96 -> 24 1x1 conv at 56x56 took 0.075 ms alone and a median 0.22 ms interleaved with
# kiln's; sent to sleep first (an atomic store), in the timed pick as in the run
_REST_FIRST = native.available


def _kiln_conv(a, x, w, b, r, geo):
    """kiln's own kernel for this conv as ``(x, r) -> y`` (NHWC in and out), or None where none
    applies: a 1x1 convolution without padding is kiln's GEMM on the activations seen as an
    [N H W, C] matrix (channels-last makes that a view; with a stride, the pixels it reads are
    first gathered into one), a 3x3 one with stride 1 and dilation 1 over multiples of 8
    channels is Winograd F(2x2, 3x3) (:func:`kiln.native.conv3x3_fn`). Both apply the bias,
    the residual and the activation in registers. The weight is constant (the layout pass
    marks only those ``nhwc``), so it is packed here once."""
    pad, stride, dil = geo[:3]
    end = geo[3] if len(geo) > 3 else pad
    k_out, c, kh, kw = w.shape
    if not native.available or (b is not None and b.dtype != torch.float32):
        return None
    b = None if b is None else b.contiguous()
    if (a.group or 1) == x.shape[1] == k_out and c == 1:
        return _kiln_depthwise(a, x, w, b, pad, end, stride, dil)
    if (a.group or 1) != 1 or x.shape[1] != c:
        return None
    if list(end) != list(pad):
        return _kiln_direct(a, x, w, b, pad, end, stride, dil)

    if (kh, kw) == (1, 1) and list(pad) == [0, 0]:
        gemm = native.gemm_fn(native.PackedWeight(w.reshape(k_out, c).t()), b, a.activation,
                              a.alpha, a.beta)
        sh, sw = stride

        def conv1x1(x, r):
            xs = nhwc(x)
            if (sh, sw) != (1, 1):  # strided: the pixels it reads, gathered into rows
                xs = xs[:, ::sh, ::sw].contiguous()
            nb, h, wd = xs.shape[:3]
            y = torch.empty((nb, h, wd, k_out), dtype=torch.float32)
            gemm(xs.reshape(-1, c), None if r is None else nhwc(r).reshape(-1, k_out),
                 y.view(-1, k_out))
            return y.permute(0, 3, 1, 2)
        conv1x1.native = dict(_native_epilogue(a, b), kind="gemm", weight=gemm.keep[0].data,
                              stride=tuple(stride))
        return conv1x1
    if ((kh, kw) == (3, 3) and list(stride) == [1, 1] and list(dil) == [1, 1] and c % 8 == 0
            and k_out % 8 == 0):
        conv = native.conv3x3_fn(native.WinogradWeight(w.contiguous()), b, a.activation,
                                 a.alpha, a.beta)
        pt, pl = pad

        def winograd(x, r):
            nb, _, h, wd = x.shape
            y = torch.empty((nb, h + 2 * pt - 2, wd + 2 * pl - 2, k_out), dtype=torch.float32)
            conv(nhwc(x), (pt, pl), None if r is None else nhwc(r), y)
            return y.permute(0, 3, 1, 2)
        winograd.native = dict(_native_epilogue(a, b), kind="winograd",
                               weight=conv.keep[0].data, pad=(pt, pl))
        return winograd
    return _kiln_direct(a, x, w, b, pad, end, stride, dil)


def _kiln_direct(a, x, w, b, pad, end, stride, dil):
    """kiln's direct convolution (:func:`kiln.native.conv_fn`) for any other one-group conv:
    NHWC, pads per side, bias, residual and activation in registers; its register block
    wants few input channels per tap (a network's 3-channel stem), and oneDNN competes."""
    return _kiln_nhwc_conv("direct", native.conv_fn, native.ConvWeight, a, x, w, b, pad, end,
                           stride, dil)


def _kiln_nhwc_conv(kind, make, weight, a, x, w, b, pad, end, stride, dil):
    """A kiln NHWC conv kernel (``make``: :func:`kiln.native.conv_fn` or
    :func:`kiln.native.depthwise_fn`, ``weight`` its packing) as the node's function, with
    what a native program record of it needs; None where the output would be empty."""
    k_out, _, kh, kw = w.shape
    h, wd = x.shape[2:]
    ho = (h + pad[0] + end[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + pad[1] + end[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    if min(ho, wo) < 1:
        return None
    conv = make(weight(w), tuple(stride), tuple(dil), b, a.activation, a.alpha, a.beta)
    pt, pl = pad

    def run(x, r):
        y = torch.empty((x.shape[0], ho, wo, k_out), dtype=torch.float32)
        conv(nhwc(x), (pt, pl), None if r is None else nhwc(r), y)
        return y.permute(0, 3, 1, 2)
    run.native = dict(_native_epilogue(a, b), kind=kind, weight=conv.keep[0].data,
                      kernel=(kh, kw), stride=tuple(stride), dilation=tuple(dil), pad=(pt, pl))
    return run


def nhwc(t):
    """A 4-D NCHW tensor as a contiguous NHWC view (copied to channels-last if it is not). A
    float32 CPU copy is kiln's transposing copy (pointwise.c): a 3 x 224 x 224 image took torch
    52 us and it 21 on one thread, and a kiln stem's timed pick against oneDNN, whose input is
    the model's NCHW image, paid torch's (165 us against oneDNN's 147 where the conv itself
    took 103; a native program makes the same copy with kiln's kernel)."""
    if (native.available and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last)):
        y = torch.empty(t.shape, dtype=torch.float32, memory_format=torch.channels_last)
        native.pointwise("Copy", t, out=y)
        return y.permute(0, 2, 3, 1)
    return t.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)


def _native_epilogue(a, b) -> dict:
    """What a native program record of a kiln conv needs of its epilogue."""
    lo, hi = native._epilogue_params(a.activation, a.alpha, a.beta)
    return {"bias": b, "act": native.ACTIVATIONS[a.activation], "lo": lo, "hi": hi}


def _kiln_depthwise(a, x, w, b, pad, end, stride, dil):
    """kiln's depthwise kernel (:func:`kiln.native.depthwise_fn`): NHWC, pads per side (an
    asymmetric "same" pad or a folded Pad), bias, residual and activation in registers."""
    return _kiln_nhwc_conv("depthwise", native.depthwise_fn, native.DepthwiseWeight, a, x, w,
                           b, pad, end, stride, dil)


def _conv_cpu(n, x, w, b, r, geo):
    """A float32 NHWC conv on the CPU by this node's tactic for the shapes of ``x`` and ``r``:
    oneDNN's convolution, or kiln's own kernel where one applies (:func:`_kiln_conv`). The
    first run per shape times the two against each other and checks kiln's against oneDNN's
    output (as :func:`linear` does; the pick is kept per signature for the whole process);
    the tactic's function, its packed weight with it, stays in ``n.cache``."""
    key = (tuple(x.shape), None if r is None else tuple(r.shape))
    plans = n.cache.get("conv_plans")
    if plans is not None and n.cache.get("conv_src") is w:
        fn = plans.get(key)
        if fn is not None:
            return fn(x, r)
    with _lock(n):
        if n.cache.get("conv_src") is not w:
            n.cache["conv_src"], n.cache["conv_plans"] = w, {}
        plans = n.cache["conv_plans"]
        fn = plans.get(key)
        if fn is not None:
            return fn(x, r)
        y, fn = _plan_conv(n, x, w, b, r, geo)
        if len(plans) >= _MAX_PACKED:
            del plans[next(iter(plans))]
        plans[key] = fn
        n.cache.setdefault("conv_tactics", {})[key] = fn.tactic
        if fn.tactic != "onednn":  # oneDNN's packed copy for this shape is not run again
            n.cache.get("packed", {}).pop(key[0], None)
            host.release_pages(w)
    return y if y is not None else fn(x, r)


def _plan_conv(n, x, w, b, r, geo):
    """(the output where picking the tactic made it, else None; the tactic's function, its
    name in ``.tactic``)."""
    a, name, y = n.a, _FORCED_CONV, None
    if name and name not in CONV_TACTICS:
        raise ValueError(f"KILN_CPU_CONV={name!r}: expected one of {', '.join(CONV_TACTICS)}")

    def onednn(x, r):
        if _REST_FIRST and torch.get_num_threads() > 1:
            native.team_rest()  # kiln's spinning workers would hold the cores OpenMP's want
        return _conv_onednn(n, x, w, b, r, geo)

    asymmetric = len(geo) > 3  # oneDNN here takes symmetric pads only
    kiln = None if name == "onednn" and not asymmetric else _kiln_conv(a, x, w, b, r, geo)
    direct = None
    if kiln is not None and not asymmetric and name in ("", "kiln_direct"):
        kind = kiln.native["kind"]
        if kind == "direct":
            direct = kiln
        elif kind == "winograd" or (kind == "gemm" and (name == "kiln_direct"
                                                          or tuple(geo[1]) != (1, 1))):
            direct = _kiln_direct(a, x, w, b, geo[0], geo[0], geo[1], geo[2])
    if name == "kiln_direct" and direct is None:
        name = "kiln"  # (a depthwise conv: no direct one)
    if asymmetric:
        if kiln is None:
            def onednn(x, r):  # the reference conv, which pads explicitly
                return epilogue(conv_reference(n, x, w, b), a, r)
            name = "onednn"
        else:
            name = "kiln"
    elif kiln is None:
        name = "onednn"
    elif not name:
        sig = ("conv", tuple(x.shape), tuple(w.shape), *map(tuple, geo), b is not None,
               a.activation, a.alpha, a.beta, None if r is None else tuple(r.shape),
               torch.get_num_threads())
        with _choices_lock:
            name = _choices.get(sig) or _nearest(sig)  # (a nearby pick is not stored)
            if name is None:
                credit = {"kiln": PROGRAM_CREDIT_S, "kiln_direct": PROGRAM_CREDIT_S} \
                    if SETTINGS.cpu_program else None
                fns = {"onednn": onednn, "kiln": kiln}
                if direct is not None and direct is not kiln:
                    fns["kiln_direct"] = direct
                name, y = _select(fns, x, r, CONV_TACTICS, credit)
                _choices[sig] = name
            if name == "kiln_direct" and direct is None:  # (a pick read from elsewhere)
                name = "kiln"
            _note(sig, name)
    fn = {"onednn": onednn, "kiln": kiln, "kiln_direct": direct}[name]
    fn.tactic = name
    return y, fn


# ---------------------------------------------------------------- CUDA channels-last convs

CUDA_CHANNELS_LAST = True  # False: CUDA convs run NCHW through F.conv2d (the A/B switch)
_NHWC_DTYPES = (torch.float16, torch.bfloat16)


def _on_cuda(x) -> bool:
    return x.device.type == "cuda"


def _nhwc_cuda(x, w) -> bool:
    """Run this conv channels-last (CUDA, 4-D FP16/BF16 input and weight)?"""
    return (CUDA_CHANNELS_LAST and x.dim() == 4 and w.dim() == 4 and x.dtype in _NHWC_DTYPES
            and w.dtype == x.dtype and _on_cuda(x))


def _weight_nhwc(n, w):
    """``w`` in channels_last memory format, made once per node, device and dtype (the engine's
    weight is a plain NCHW array; converting it on every call would copy it every call)."""
    key = ("w_nhwc", w.device, w.dtype)
    pair = n.cache.get(key)
    if pair is None or pair[0] is not w:
        # (a race makes the same tensor twice; either is right)
        pair = n.cache[key] = (w, w.contiguous(memory_format=torch.channels_last))
    return pair[1]


def _shares_memory(y, t) -> bool:
    return t is not None and y.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _conv_nhwc(n, x, w, b, r):
    if not x.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    y = conv_reference(n, x, _weight_nhwc(n, w), b)  # cuDNN: channels-last in, out
    if _shares_memory(y, x) or _shares_memory(y, r):  # never for a conv; out of place if so
        y = y.clone(memory_format=torch.channels_last)
    return epilogue(y, n.a, r)  # residual add_ and activation in place on the fresh NHWC y


@register(FC.FusedConv, makes_plan=cudnn)
def fused_conv(n, x, w, b=None, r=None):
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    if _nhwc_cuda(x, w):
        return _conv_nhwc(n, x, w, b, r)
    if _onednn_ok(n.a, x, w):
        geo = symmetric_geometry(n, x, w)
        if geo is not None:  # the pass fuses only residuals of the output's own shape
            return _conv_cpu(n, x, w, b, r, geo[:3])
        asym = _asymmetric(n, x, w)
        if asym is not None:
            return _conv_cpu(n, x, w, b, r, asym)
    return epilogue(conv_reference(n, x, w, b), n.a, r)


# ---------------------------------------------------------------- CPU linear tactics

PACKED_LINEAR = True  # False: plain F.linear everywhere (the switch A/B benchmarks flip)
TACTICS = ("linear", "mkl", "onednn", "onednn_fused", "kiln")
_FORCED = SETTINGS.cpu_linear  # a forced tactic, for repeatable measurements
_HAVE_MKL = (torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")
             and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
_HAVE_ONEDNN = (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
_TIME_BUDGET_S = 0.2  # timing per signature and candidate, at most (beyond two warm-up runs)
# interleaved timing rounds: at least (where the budget allows one), at most. 10 rounds picked
# oneDNN for a 96 -> 24 1x1 conv at 56x56 in one selection and kiln's GEMM in the next on this
# shared VM (kiln's best of 9 runs: 0.11 ms in one, 0.22 ms in another)
_MIN_ROUNDS, _MAX_ROUNDS = 3, 40
_RTOL = 1e-5  # a candidate further than this from F.linear (relative to max |y|) is dropped
# A weight with more output features than this is timed on its first _SLICE_N of them: each
# candidate packs its own copy of what it is timed on, and the heap keeps freed memory, so
# GPT-2's LM head (50257 x 768, 154 MB) cost three packed copies plus the candidates' outputs
_SLICE_N = 4096
# A product of at most this many multiply-adds takes kiln's GEMM untimed: timing a few
# microseconds of work measures the machine's noise, and in a native program kiln's GEMM is a
# record where the others are a call back into Python (a GRU's 96 x 8 head)
KILN_BELOW = 1 << 15
# A product of at most KILN_FEW_ROWS rows (a decoder step's, M = 1) and at most this many
# multiply-adds takes kiln's GEMM untimed too: such a product is read-the-weight-once work, a
# few to a few dozen microseconds, which the timing on a shared 2-core machine called for
# F.linear on some builds and for kiln on others (1 x 256 x 1024: kiln 10.5 us against
# F.linear's 15.2 us on 2 threads, 29 us against 15 in a noisier minute), and F.linear is a
# torch record in a native program (8 of a GPT-2 decode step's 127 layers)
KILN_FEW_ROWS, KILN_FEW_ROWS_BELOW = 4, 1 << 22

_choices: dict = {}  # signature -> tactic name, for the whole process
# other kernels' picks kept in _choices (and so in engine files): a signature whose first
# item is one of these keys, with its tactic names (int8.py's "int8": fbgemm/onednn/qgemm)
FOREIGN_TACTICS: dict[str, frozenset] = {}
_choices_lock = threading.Lock()
_recorders: list[dict] = []  # open record_picks() blocks


# A shape not timed takes the pick of the nearest timed shape of the same layer (same weight,
# epilogue and threads; rows, or batch x pixels, within this factor), as TensorRT runs every
# shape of a profile on the tactic timed at its opt shape: a dynamic batch then times nothing
# on the request path. Further off (a profile-less engine tuned at 1 token, run at 128) the
# shape is timed at its first run. The builder's tuning run always times (its profiles' opt
# shapes are what it is there to time).
NEAREST_WITHIN = 8.0


def _family(sig) -> tuple[tuple, int]:
    """(the signature less its rows, its rows): a conv's batch x pixels, a GEMM's rows."""
    conv = sig[0] == "conv"
    xs = sig[1] if conv else sig[0]
    rows = xs[0] * math.prod(xs[2:]) if conv else math.prod(xs[:-1])
    head = ("conv", xs[1]) if conv else (xs[-1],)
    rest = sig[2:] if conv else sig[1:]
    return (*head, *rest[:-2], rest[-2] is None, rest[-1]), rows


def _nearest(sig) -> str | None:
    """The pick of the timed signature nearest ``sig`` in rows (under ``_choices_lock``), if
    one is within NEAREST_WITHIN and no build is timing picks now."""
    if _recorders or NEAREST_WITHIN <= 1:
        return None
    fam, rows = _family(sig)
    best, dist = None, math.log(NEAREST_WITHIN)
    for other, name in _choices.items():
        if len(other) != len(sig) or (other[0] == "conv") != (sig[0] == "conv") or \
                other[0] in FOREIGN_TACTICS:
            continue
        f, n = _family(other)
        if f == fam and rows > 0 and n > 0 and abs(math.log(n / rows)) <= dist:
            best, dist = name, abs(math.log(n / rows))
    return best


def _note(sig, name: str) -> None:
    for r in _recorders:
        r[sig] = name


class record_picks:
    """``with record_picks() as picks:`` collects every CPU GEMM and conv tactic pick (made or
    read) in the block, signature -> tactic: what the builder stores in a CPU engine."""

    def __enter__(self) -> dict:
        self.picks: dict = {}
        with _choices_lock:
            _recorders.append(self.picks)
        return self.picks

    def __exit__(self, *exc) -> None:
        with _choices_lock:
            _recorders.remove(self.picks)


def preload_picks(picks: dict) -> None:
    """Make these picks (from an engine file or the timing cache) the process's, so that the
    first run of the kernels they cover times nothing."""
    with _choices_lock:
        for sig, name in picks.items():
            if name in TACTICS or name in CONV_TACTICS or \
                    name in FOREIGN_TACTICS.get(sig[0] if sig and isinstance(sig[0], str)
                                                else None, ()):
                _choices.setdefault(sig, name)


def picks_to_json(picks: dict) -> list:
    return [[list(_jsonable(k)), v] for k, v in picks.items()]


def picks_from_json(rows) -> dict:
    """Signature tuples back from :func:`picks_to_json`'s lists; raises ValueError on a
    malformed table."""
    try:
        return {_tuples(k): str(v) for k, v in rows}
    except (TypeError, ValueError) as e:
        raise ValueError(f"a malformed CPU tactic table ({e})") from None


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _linear_ok(x, wt, b, r) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() >= 2
            and x.device.type == "cpu" and x.numel() > 0
            and wt.dtype == torch.float32 and wt.dim() == 2
            and x.shape[-1] == wt.shape[1]
            and (b is None or (b.dtype == torch.float32 and b.shape == wt.shape[:1]))
            and (r is None or r.dtype == torch.float32))


def _build(name, x, wt, b, a, r):
    """The tactic ``name`` as ``(x, r) -> act(x @ wt^T + b + r)``, its weight packed for the
    shape of ``x``; None where it does not apply (or this torch lacks it)."""
    n_out, k = wt.shape
    m = x.numel() // k
    out_shape = (*x.shape[:-1], n_out)
    if name == "linear":
        return lambda x, r: epilogue(F.linear(x, wt, b), a, r)
    if name == "mkl":
        if not _HAVE_MKL:
            return None
        pk = torch.ops.mkl._mkl_reorder_linear_weight(wt.contiguous(), m)

        def mkl(x, r):
            y = torch.ops.mkl._mkl_linear(x.contiguous().view(m, k), pk, wt, b, m)
            return epilogue(y.view(out_shape), a, r)
        return mkl
    if name == "kiln":
        return _kiln_gemm(x, wt, b, a, r, m, k, out_shape)
    if not _HAVE_ONEDNN:
        return None
    if name == "onednn":
        pd = torch.ops.mkldnn._reorder_linear_weight(wt.contiguous(), m)
        return lambda x, r: epilogue(
            torch.ops.mkldnn._linear_pointwise(x.contiguous(), pd, b, "none", [], ""), a, r)
    # onednn_fused: the residual add (a binary post-op), else the activation (a unary one)
    if r is not None:
        if tuple(r.shape) != out_shape:
            return None
        pd = torch.ops.mkldnn._reorder_linear_weight(wt.contiguous(), m)

        def binary(x, r):
            y = torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), r.contiguous(), pd,
                                                          b, "add")
            return _TORCH_ACT[a.activation](y, a)
        return binary
    if not a.activation or a.activation in _AFTER_ONEDNN:
        return None
    attr, scalars, algo = _ONEDNN_ACT[a.activation]
    pd = torch.ops.mkldnn._reorder_linear_weight(wt.contiguous(), m)
    sc = scalars(a)
    return lambda x, r: torch.ops.mkldnn._linear_pointwise(x.contiguous(), pd, b, attr, sc, algo)


def _kiln_gemm(x, wt, b, a, r, m, k, out_shape):
    """kiln's own AVX2 GEMM (:mod:`kiln.native`) on the weight packed into its panels, with the
    bias, the residual and the activation applied to the tile in registers."""
    if not native.available or k < 1 or (b is not None and not b.is_contiguous()):
        return None
    fuse_r = r is not None and tuple(r.shape) == out_shape  # else added after, then act
    act = a.activation if r is None or fuse_r else ""
    run = native.gemm_fn(native.PackedWeight(wt.t()), b, act, a.alpha, a.beta)
    n_out = wt.shape[0]

    def kiln(x, r):
        x2 = x.reshape(m, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        rr = None
        if fuse_r:
            rr = r.reshape(m, n_out)
            if rr.stride(1) != 1:
                rr = rr.contiguous()
        y = run(x2, rr, torch.empty((m, n_out), dtype=torch.float32)).view(out_shape)
        return y if r is None or fuse_r else epilogue(y, a, r)  # else r, then act, in torch
    kiln.packed = run.keep[0] if r is None or fuse_r else None  # for a native program record
    return kiln


def _signature(x, wt, b, a, r):
    return (tuple(x.shape), tuple(wt.shape), b is not None, a.activation, a.alpha, a.beta,
            None if r is None else tuple(r.shape), torch.get_num_threads())


def _select(fns: dict, x, r, order=TACTICS, credit: dict | None = None, clock=None):
    """The fastest of ``fns`` (name -> fn, the reference first) on these inputs, and its
    output. Each runs once and is checked against the first one's result (a candidate further
    off is dropped), runs once more untimed (its first call set up primitives, scratch, a
    thread team), then all run interleaved, in the reverse order every other round (so that
    none always runs right after another), for as many rounds as ``_TIME_BUDGET_S`` allows
    (``_MIN_ROUNDS`` .. ``_MAX_ROUNDS``). The fastest run of each counts (contention only adds
    time; on a shared 2-core machine a 2-thread run is uncontended only now and then, so
    small candidates get many rounds), less its ``credit`` (name -> seconds) where given; a
    tie goes to the earlier name in ``order``. ``clock`` (default ``time.perf_counter``) is
    for tests."""
    clock = clock or time.perf_counter
    first, ref, ref_name, scale = {}, None, None, 0.0
    for name, fn in fns.items():
        t0 = clock()
        y = fn(x, r)
        dt = clock() - t0
        if ref is None:
            ref, ref_name, scale = y, name, float(y.abs().max())
        elif y.shape != ref.shape or not float((y - ref).abs().max()) <= _RTOL * scale:
            continue  # (a NaN anywhere fails the check too)
        first[name] = dt
        del y  # only the reference output is kept: a GPT-2 b8 LM head's is 200 MB
    names = list(first)
    slowest = max(first.values())
    best = dict(first)
    if slowest < _TIME_BUDGET_S:  # (a candidate that slow is timed by its first run alone)
        for name in names:
            fns[name](x, r)  # warm, untimed
        best = dict.fromkeys(names, math.inf)
        rounds = max(_MIN_ROUNDS, min(_MAX_ROUNDS, int(_TIME_BUDGET_S / max(slowest, 1e-9))))
        for k in range(rounds):
            for name in (names if k % 2 == 0 else reversed(names)):
                t0 = clock()
                fns[name](x, r)
                best[name] = min(best[name], clock() - t0)
    credit = credit or {}
    name = min(best, key=lambda k: (best[k] - credit.get(k, 0.0), order.index(k)))
    return name, ref if name == ref_name else fns[name](x, r)


def _lock(n):
    lock = n.cache.get("lin_lock")
    if lock is None:
        lock = n.cache.setdefault("lin_lock", threading.Lock())  # atomic: one lock wins
    return lock


def linear(n, x, wt, b, a, r=None, src=None):
    """``act(x @ wt^T + b + r)`` (``a``: the fused-op attributes with the epilogue), by this
    node's tactic for the shape of ``x``. ``wt`` is [out, in], possibly a transposed view of
    ``src``, the node's weight input: MKL reads a transposed view as it is and the CPU tactics
    pack from it, so no transposed copy of the weight is made or kept. ``src`` (default:
    ``wt``) must be the same tensor object on every run for the weight to count as constant.
    The first run per shape picks the tactic (or reads the process-wide pick for the
    signature) and packs the weight for it; both stay in ``n.cache`` (a few shapes per
    node)."""
    if not PACKED_LINEAR or n.cache.get("lin_dynamic") or not _linear_ok(x, wt, b, r):
        return epilogue(F.linear(x, wt, b), a, r)
    src_in = wt if src is None else src
    key = (tuple(x.shape), None if r is None else tuple(r.shape))
    plans = n.cache.get("lin_plans")
    if plans is not None and n.cache.get("lin_src") is src_in:
        fn = plans.get(key)
        if fn is not None:
            return fn(x, r)
    with _lock(n):
        seen = n.cache.get("lin_src")
        if seen is not None and seen is not src_in:  # not a constant: packing would not pay
            n.cache["lin_dynamic"] = True
            n.cache.pop("lin_plans", None)
            return epilogue(F.linear(x, wt, b), a, r)
        if seen is None:
            n.cache["lin_plans"], n.cache["lin_src"] = {}, src_in
        plans = n.cache["lin_plans"]
        fn = plans.get(key)
        if fn is not None:
            return fn(x, r)
        y, fn = _plan(x, wt, b, a, r)
        if len(plans) >= _MAX_PACKED:
            del plans[next(iter(plans))]
        plans[key] = fn
        n.cache.setdefault("lin_tactics", {})[key] = fn.tactic
        if all(f.tactic != "linear" for f in plans.values()):
            host.release_pages(src_in)  # packed: the weight's engine-file pages can go
    return y if y is not None else fn(x, r)


def _plan(x, wt, b, a, r):
    """(the output where picking the tactic made it, else None; the tactic's function, its
    name in ``.tactic``)."""
    y, name = None, _FORCED
    if name:
        if name not in TACTICS:
            raise ValueError(f"KILN_CPU_LINEAR={name!r}: expected one of {', '.join(TACTICS)}")
        fn = _build(name, x, wt, b, a, r)
        if fn is None:
            name, fn = "linear", _build("linear", x, wt, b, a, r)
    else:
        sig = _signature(x, wt, b, a, r)
        with _choices_lock:
            name = _choices.get(sig)
            kiln = None
            rows = x.numel() // x.shape[-1]
            if name is None and (rows * wt.numel() <= KILN_BELOW or (
                    rows <= KILN_FEW_ROWS and rows * wt.numel() <= KILN_FEW_ROWS_BELOW)):
                kiln = _build("kiln", x, wt, b, a, r)
            if kiln is not None:  # too small to time fairly: kiln's (a native program record)
                name, fn = "kiln", kiln
                _choices[sig] = name
            elif name is None and (name := _nearest(sig)) is not None:
                pass  # not stored: only timed picks are anchors (no drift from shape to shape)
            elif name is None:
                ws, bs, rs = wt, b, r
                sliced = wt.shape[0] > _SLICE_N  # timed on a slice; the pick then packs it whole
                if sliced:
                    ws, bs = wt[:_SLICE_N], None if b is None else b[:_SLICE_N]
                    rs = r if r is None or r.shape[-1] != wt.shape[0] else r[..., :_SLICE_N]
                fns = {t: f for t in TACTICS if (f := _build(t, x, ws, bs, a, rs)) is not None}
                # in a native program kiln's GEMM is a record, where the others are a torch
                # record: the timed call's Python plus the program's call back into Python
                # and its views of the operands (LINEAR_PROGRAM_CREDIT_S); a decoder step's
                # M = 1 products timed level took F.linear by noise, each a torch record
                credit = {"kiln": LINEAR_PROGRAM_CREDIT_S} if SETTINGS.cpu_program else None
                name, y = _select(fns, x, rs, TACTICS, credit)
                if sliced:
                    y = None  # the slice's output: the whole weight's function is built below
                else:
                    fn = fns[name]
                _choices[sig] = name
                del fns
            _note(sig, name)
        if y is None and kiln is None:
            fn = _build(name, x, wt, b, a, r)
            if fn is None:  # a nearby shape's pick that does not apply to this one
                name, fn = "linear", _build("linear", x, wt, b, a, r)
    fn.tactic = name
    return y, fn


@register(FC.FusedMatMulLayerNorm, makes_plan=cublas)
def fused_matmul_layernorm(n, x, w, b=None, r=None, scale=None, ln_bias=None):
    """LayerNorm(FusedMatMul(x, w, b, r)) over the last dim: the product by its tactic, then the
    norm in place on that fresh output (kiln's C library on the CPU, F.layer_norm elsewhere)."""
    y = fused_matmul(n, x, w, b, r)
    eps = n.a.epsilon
    if native.available and native.layer_norm_fits(y, scale, ln_bias):
        return native.layer_norm_(y, scale, ln_bias, eps)
    return F.layer_norm(y, y.shape[-1:], scale, ln_bias, eps)


@register(FC.FusedMatMul, makes_plan=cublas)
def fused_matmul(n, x, w, b=None, r=None):
    if w.dim() == 2 and x.dim() >= 2 and x.dtype.is_floating_point:
        return linear(n, x, w.t(), b, n.a, r, src=w)
    y = torch.matmul(x, w)
    if b is not None:
        y = y.add_(b) if tuple(y.shape) == broadcast_ints(y.shape, b.shape) else y + b
    return epilogue(y, n.a, r)


@register(FC.FusedGemm, makes_plan=cublas)
def fused_gemm(n, a_in, b_in, c=None, r=None):
    a = n.a
    x = a_in.t() if a.transA else a_in
    if c is not None and c.dim() == 1 and x.dtype.is_floating_point:
        wt = b_in if a.transB else b_in.t()
        return linear(n, x, wt, c, a, r, src=b_in)
    y = torch.matmul(x, b_in.t() if a.transB else b_in)
    if c is not None:
        y = y + c
    return epilogue(y, a, r)
