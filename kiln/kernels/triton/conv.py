"""FusedConv on CUDA: cuDNN's convolution, its epilogue in one pass or fused by cuDNN.

The PyTorch kernel runs a channels-last conv2d *with* bias, which PyTorch adds as a separate
broadcast kernel, then the residual add and the activation in place: up to three extra passes
over the output. Here, for 2-D convs on FP16/BF16 with symmetric pads, tactics:

- ``{"epilogue": "triton", "BLOCK", "num_warps"}``: cuDNN conv *without* bias, channels-last
  (input, weight and so output NHWC), then one Triton kernel in place over the output::

      y[p, c] = act(y[p, c] + bias[c] + residual[p, c])     (y, residual: NHWC as [N*H*W, C])

  Each program takes a [BLOCK_P, BLOCK_C] tile of that matrix (BLOCK elements), so the channel
  of an element is its column: no division per element, and the bias is read once per tile.
- ``{"epilogue": "cudnn"}`` (CUDA, Relu only): cuDNN's fused ``conv + bias (+ z) -> relu``
  through ``torch.cudnn_convolution_relu`` / ``torch.cudnn_convolution_add_relu``.
- 1x1 convolutions (no padding or dilation, one group; a stride is a slice first) are a GEMM
  on the NHWC activations seen as an [N*H*W, C] matrix: ``{"impl": "gemm", <GEMM tile>}``
  runs kiln's Triton GEMM with the bias, residual and activation in its epilogue (one kernel,
  embedded in the engine file); ``{"impl": "cublas"}`` runs cuBLAS then the Triton epilogue
  pass; ``{"impl": "cublaslt"}`` (bias + ReLU, no residual) runs cuBLASLt with the bias and
  the ReLU in its own epilogue, no pass at all. None has cuDNN's per-shape plan creation (tens
  of ms per layer shape at an engine's first run), which is what an engine's load + first
  inference time is mostly made of.
- Any one-group conv but a plain 1x1: ``{"impl": "igemm", <tile>}``, kiln's implicit-GEMM
  Triton conv (``implicit_gemm.py``) with the epilogue fused; like the GEMM tactics it runs
  from the engine's embedded binaries, with no cuDNN plan to make at the first run.
- Depthwise convs (one group per input channel): ``{"impl": "depthwise", <tile>}``, a direct
  Triton kernel over NHWC tiles with the epilogue fused (``depthwise.py``).

- A stem conv of fewer than PAD_C (4) input channels (an image's 3): ``"pad_c": 4`` on the
  cuDNN tactics. cuDNN's first-layer kernels read 4-channel NHWC pixels, so for a 3-channel
  input PyTorch's channels-last copy of the NCHW image and then cuDNN's own channel-padding
  kernel ran before it (ResNet-50 b256 on the H200: 0.10 + 0.12 ms of a 6.7 ms pass); one
  Triton pass writes the NHWC image with a zero fourth channel instead, for the weight padded
  likewise once per node (the zero channel adds nothing to any output).

Asymmetric pads, other ranks and dtypes, or a residual not of the output's shape run the
PyTorch kernel. Under ``TRITON_INTERPRET=1`` CPU tensors of any float dtype take the Triton
tactics (the conv is then PyTorch's CPU conv), so CPU-only CI covers the epilogue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.kernels.torch import fused_conv as torch_fused
from kiln.kernels.triton import depthwise, implicit_gemm
from kiln.kernels.triton.common import (
    FLOATS,
    HALF,
    launch,
    on_device,
    rows_epilogue_,
    tactic_of,
)
from kiln.kernels.triton.gemm import LT_ACTS, gemm2d, gemm_tactics, lt_fuses
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import fused_conv as FC

CL = torch.channels_last
DEFAULT = {"epilogue": "triton", "BLOCK": 1024, "num_warps": 4}
# (BLOCK, num_warps) of the Triton epilogue: 8 to 16 elements a thread. On an H200 the pass
# runs at ~4.2 TB/s with any of them (within 5% of each other at ResNet-50's shapes)
_CONFIGS = ((1024, 4), (2048, 4), (4096, 8))
_HAVE_CUDNN_FUSED = (hasattr(torch, "cudnn_convolution_relu")
                     and hasattr(torch, "cudnn_convolution_add_relu"))


def bias_act_(y, bias=None, res=None, activation: str = "", alpha: float = 0.0,
              beta: float = 0.0, block: int = 1024, num_warps: int = 4):
    """``y = act(y + bias[c] + res)`` in place on a channels-last 4-D ``y`` (``res``:
    channels-last, y's shape; ``bias``: C values). Returns ``y``."""
    if not y.is_contiguous(memory_format=CL) or (
            res is not None and (res.shape != y.shape or not res.is_contiguous(memory_format=CL))):
        raise ValueError("bias_act_: y and the residual must be channels-last, of one shape")
    return rows_epilogue_(y, y.shape[1], bias, res, activation, alpha, beta, block, num_warps)


PAD_C = 4  # the channel count cuDNN's first-layer kernels read NHWC pixels in


@jit
def _pad_nhwc_kernel(X, Y, P, C, H, W, s_n, s_c, s_h, s_w, CP: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """Y [P = N*H*W pixels, CP] = X's C channels (read through its strides), zeros after."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, CP)
    n, h, w = p // (H * W), (p // W) % H, p % W
    ok = p < P
    src = (X + n[:, None].to(tl.int64) * s_n + c[None, :] * s_c + h[:, None] * s_h
           + w[:, None] * s_w)
    v = tl.load(src, mask=ok[:, None] & (c[None, :] < C), other=0.0)
    tl.store(Y + p[:, None].to(tl.int64) * CP + c[None, :], v, mask=ok[:, None])


def pad_channels_nhwc(x, cp: int = PAD_C, block_p: int = 256):
    """``x`` [N, C, H, W] (any strides, C <= cp) as a channels-last [N, cp, H, W] tensor whose
    channels from C on are zero: one pass."""
    nb, c, h, w = x.shape
    y = torch.empty((nb, cp, h, w), dtype=x.dtype, device=x.device, memory_format=CL)
    pixels = nb * h * w
    launch(_pad_nhwc_kernel, (cdiv(pixels, block_p),), x, y, pixels, c, h, w, *x.stride(),
           CP=cp, BLOCK_P=block_p, num_warps=4)
    return y


def _weight_padded(n, w, cp: int):
    """``w`` [Co, C, kh, kw] with zero input channels up to ``cp``, channels-last, made once per
    node, device and dtype."""
    key = ("w_pad", w.device, w.dtype, cp)
    pair = n.cache.get(key)
    if pair is None or pair[0] is not w:
        wp = torch.zeros((w.shape[0], cp, *w.shape[2:]), dtype=w.dtype, device=w.device)
        wp[:, :w.shape[1]] = w
        pair = n.cache[key] = (w, wp.contiguous(memory_format=CL))
    return pair[1]


def _pads_stem(n, x, w) -> bool:
    """A one-group conv of fewer than PAD_C input channels that runs cuDNN (symmetric pads)."""
    return (n.a.group or 1) == 1 and x.shape[1] < PAD_C and not _direct_only(n, x, w)


# ---------------------------------------------------------------- the op


def _geometry(n, x, w):
    """(padding, stride, dilation, output H, W) as cuDNN takes them, or None where the pads
    are asymmetric or negative or the output is empty."""
    geo = torch_fused.symmetric_geometry(n, x, w)
    return geo if geo is not None and min(geo[0]) >= 0 and min(geo[3]) > 0 else None


def _direct_geometry(n, x, w):
    """The geometry Triton's direct kernels (implicit GEMM, depthwise) take: (begin pads,
    stride, dilation, output H, W). They read the input through bounds masks, so the end pads
    only set the output size and may differ from the begin pads (TF-style "same" padding of a
    stride-2 conv: 0 before, 1 after). None where a pad is negative or the output is empty."""
    outs, pb, pe, s, d = torch_fused.conv_window(n, x, w)
    ok = min(pb) >= 0 and min(pe) >= 0 and min(outs) > 0
    return (pb, s, d, outs) if ok else None


def _direct_only(n, x, w) -> bool:
    """Asymmetric pads: only the direct kernels (one-group or depthwise) can run the conv."""
    groups = n.a.group or 1
    return (_geometry(n, x, w) is None and _direct_geometry(n, x, w) is not None
            and (groups == 1 or depthwise.is_depthwise(groups, x, w)))


def supports(n, inputs) -> bool:
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    r = inputs[3] if len(inputs) > 3 else None
    if not (on_device(x, w, b, r) and x.dim() == 4 and w.dim() == 4 and x.numel() > 0):
        return False
    # on a GPU FP16/BF16 only (cuDNN's channels-last layout); the interpreter takes any float
    if x.dtype not in (HALF if x.is_cuda else FLOATS) or w.dtype != x.dtype:
        return False
    groups = n.a.group or 1
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        return False
    if b is not None and (b.dim() != 1 or b.numel() != w.shape[0] or not b.dtype.is_floating_point):
        return False
    geo = _geometry(n, x, w) or (_direct_geometry(n, x, w) if _direct_only(n, x, w) else None)
    if geo is None:
        return False
    return r is None or (r.dtype == x.dtype and tuple(r.shape) == (x.shape[0], w.shape[0], *geo[3]))


def _cudnn_fuses(n, x) -> bool:
    return (_HAVE_CUDNN_FUSED and x.is_cuda and n.a.activation == "Relu"
            and torch.backends.cudnn.is_available())


def _pointwise(n, x, w) -> int | None:
    """The stride of a 1x1 conv that is a GEMM (no pads, no dilation, one group), else None."""
    if tuple(w.shape[2:]) != (1, 1) or (n.a.group or 1) != 1:
        return None
    pad, stride, dil, _ = _geometry(n, x, w)
    if any(pad) or any(d != 1 for d in dil) or stride[0] != stride[1]:
        return None
    return stride[0]


def tactics(n, inputs) -> list[dict]:
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    r = inputs[3] if len(inputs) > 3 else None
    out = []
    if _direct_only(n, x, w):  # asymmetric pads: the direct kernels, nothing that runs cuDNN
        _, _, _, (oh, ow) = _direct_geometry(n, x, w)
        if (n.a.group or 1) == 1:
            out += implicit_gemm.tactics(x.shape[0], x.shape[1], w.shape[0], *w.shape[2:],
                                         oh, ow)
        if depthwise.is_depthwise(n.a.group or 1, x, w):
            out += depthwise.tactics(w.shape[0], x.shape[0] * oh * ow)
        return out
    s = _pointwise(n, x, w)
    if s is not None:
        m = x.shape[0] * len(range(0, x.shape[2], s)) * len(range(0, x.shape[3], s))
        out += [dict(t, impl="gemm") for t in gemm_tactics(m, w.shape[0], w.shape[1])]
        out.append({"impl": "cublas"})
        if lt_fuses(n.a.activation, b, r):
            out.append({"impl": "cublaslt"})
    _, _, _, (oh, ow) = _geometry(n, x, w)
    if (n.a.group or 1) == 1 and s != 1:
        out += implicit_gemm.tactics(x.shape[0], x.shape[1], w.shape[0], *w.shape[2:], oh, ow)
    if depthwise.is_depthwise(n.a.group or 1, x, w):
        out += depthwise.tactics(w.shape[0], x.shape[0] * oh * ow)
    stem = [dict(DEFAULT, pad_c=PAD_C)] if _pads_stem(n, x, w) else []
    if b is None and r is None and not n.a.activation:
        return [dict(DEFAULT)] + out + stem  # nothing to fuse: the conv alone
    out += [{"epilogue": "triton", "BLOCK": blk, "num_warps": w} for blk, w in _CONFIGS]
    if _cudnn_fuses(n, x):
        out.append({"epilogue": "cudnn"})
        stem.append({"epilogue": "cudnn", "pad_c": PAD_C})
    return out + stem


def _conv1x1(n, t, x, w, b, r, stride: int):
    """A 1x1 conv as a GEMM over channels-last activations (see the module docstring)."""
    if stride > 1:
        x = x[:, :, ::stride, ::stride].contiguous(memory_format=CL)
    nb, c, h, wd = x.shape
    co = w.shape[0]
    x2 = x.permute(0, 2, 3, 1).reshape(-1, c)  # views of NHWC memory
    w2 = w.reshape(co, c)
    r2 = None if r is None else r.permute(0, 2, 3, 1).reshape(-1, co)
    a = n.a
    if t["impl"] == "cublaslt" and lt_fuses(a.activation, b, r):
        y2 = torch._addmm_activation(b, x2, w2.t(), use_gelu=LT_ACTS[a.activation])
        return y2.view(nb, h, wd, co).permute(0, 3, 1, 2)
    if t["impl"] == "gemm":
        y2 = gemm2d(n, x2, w2.t(), b, r2, a.activation, 1.0, a.alpha or 0.0, a.beta or 0.0)
        return y2.view(nb, h, wd, co).permute(0, 3, 1, 2)
    y = torch.mm(x2, w2.t()).view(nb, h, wd, co).permute(0, 3, 1, 2)
    return bias_act_(y, b, r, a.activation, a.alpha or 0.0, a.beta or 0.0)


def makes_plan(t) -> str | None:
    """The library a tactic's first call initialises: cuBLAS for the cuBLAS GEMM, none for the
    Triton GEMM, the implicit GEMM and the depthwise kernel, cuDNN for every other one."""
    impl = t.get("impl") if t else None
    if impl in ("cublas", "cublaslt"):
        return "cublas"
    return None if impl in ("gemm", "igemm", "depthwise") else "cudnn"


@register(FC.FusedConv, backend="cuda", name="TritonFusedConv", tactics=tactics,
          supports=supports, makes_plan=makes_plan)
def fused_conv(n, x, w, b=None, r=None):
    if not supports(n, (x, w, b, r)):
        return torch_fused.fused_conv(n, x, w, b, r)
    a, t = n.a, tactic_of(n, DEFAULT)
    groups = a.group or 1
    direct = _direct_only(n, x, w)
    if direct and t.get("impl") not in ("igemm", "depthwise"):
        return torch_fused.fused_conv(n, x, w, b, r)  # untuned: the torch kernel pads itself
    geo = _direct_geometry(n, x, w) if direct else _geometry(n, x, w)
    pad, stride, dil, _ = geo
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    pad_c = t.get("pad_c") if t.get("impl") is None and _pads_stem(n, x, w) else None
    if pad_c:  # the image as padded NHWC in one pass, and the weight to match
        x, w_pad = pad_channels_nhwc(x, pad_c), _weight_padded(n, w, pad_c)
    elif not x.is_contiguous(memory_format=CL):
        x = x.contiguous(memory_format=CL)
    if r is not None and not r.is_contiguous(memory_format=CL):
        r = r.contiguous(memory_format=CL)
    if t.get("impl") in ("gemm", "cublas", "cublaslt"):
        s = _pointwise(n, x, w)
        if s is not None:
            return _conv1x1(n, t, x, w, b, r, s)
    # channels-last, made once per node (a no-op if it is)
    wc = w_pad if pad_c else torch_fused._weight_nhwc(n, w)
    if t.get("impl") == "igemm" and groups == 1:
        return implicit_gemm.conv2d(t, x, wc, b, r, geo, a.activation, a.alpha or 0.0,
                                    a.beta or 0.0)
    if t.get("impl") == "depthwise" and depthwise.is_depthwise(groups, x, w):
        return depthwise.conv2d(t, x, wc, b, r, geo, a.activation, a.alpha or 0.0,
                                a.beta or 0.0)
    if t["epilogue"] == "cudnn" and _cudnn_fuses(n, x):
        if r is None:
            return torch.cudnn_convolution_relu(x, wc, b, stride, pad, dil, groups)
        return torch.cudnn_convolution_add_relu(x, wc, r, 1.0, b, stride, pad, dil, groups)
    y = F.conv2d(x, wc, None, stride, pad, dil, groups)
    if not y.is_contiguous(memory_format=CL):
        y = y.contiguous(memory_format=CL)
    return bias_act_(y, b, r, a.activation, a.alpha or 0.0, a.beta or 0.0, t["BLOCK"],
                     t["num_warps"])
