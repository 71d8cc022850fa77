"""Triton Softmax and LogSoftmax over the last axis, fp32 accumulation, one row per program.

A row that fits one BLOCK is read once; a longer row takes an online pass (running max and
rescaled sum, as flash attention does) and a second pass that writes. Tactic:
``{"BLOCK", "num_warps"}``. Other axes fall back to the PyTorch kernel.
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import nn_norm as torch_norm
from kiln.kernels.triton.common import FLOATS, launch, next_pow2, on_device, tactic_of, warps_for
from kiln.kernels.triton.lazy import jit, tl
from kiln.ops import nn as N
from kiln.ops.rules import norm_axis


@jit
def _softmax_kernel(X, Y, stride_x, stride_y, n_cols, LOG: tl.constexpr, BLOCK: tl.constexpr,
                    ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        m = cols < n_cols
        x = tl.load(x_row + cols, mask=m, other=-float("inf")).to(tl.float32)
        z = x - tl.max(x, axis=0)
        e = tl.exp(z)
        s = tl.sum(e, axis=0)
        if LOG:
            y = z - tl.log(s)
        else:
            y = e / s
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=m)
    else:
        m_run = tl.full([BLOCK], -float("inf"), tl.float32)
        s_run = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, n_cols, BLOCK):
            c = off + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m_run, x)
            # lanes that have seen only -inf keep a zero sum (avoid -inf - -inf)
            safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s_run = s_run * tl.exp(m_run - safe) + tl.exp(x - safe)
            m_run = m_new
        mx = tl.max(m_run, axis=0)
        s = tl.sum(s_run * tl.exp(m_run - mx), axis=0)
        for off in range(0, n_cols, BLOCK):
            c = off + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=-float("inf")).to(tl.float32)
            if LOG:
                y = x - mx - tl.log(s)
            else:
                y = tl.exp(x - mx) / s
            tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=c < n_cols)


def supports(n, inputs) -> bool:
    x = inputs[0]
    if not on_device(x) or x.dtype not in FLOATS or x.dim() == 0 or x.numel() == 0:
        return False
    # opset < 13 softmax flattens from `axis` on: the same as the last axis only when it is it
    return norm_axis(n.a.axis if n.a.axis is not None else -1, x.dim()) == x.dim() - 1


def tactics(n, inputs) -> list[dict]:
    cols = next_pow2(inputs[0].shape[-1])
    blocks = sorted({min(cols, b) for b in (cols, 1024, 4096)})
    return [{"BLOCK": b, "num_warps": w} for b in blocks
            for w in sorted({1, 2, 4, 8, 16} & set(range(1, max(2, b // 32) + 1)))]


def _launch(n, x, log: bool):
    cols = x.shape[-1]
    block = min(next_pow2(cols), 8192)
    t = tactic_of(n, {"BLOCK": block, "num_warps": warps_for(block)})
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(_softmax_kernel, (x2.shape[0],), x2, y, x2.stride(0), cols, cols, LOG=log,
           BLOCK=t["BLOCK"], ONE_BLOCK=t["BLOCK"] >= cols, num_warps=t["num_warps"])
    return y


@register(N.Softmax, backend="cuda", name="TritonSoftmax", tactics=tactics, supports=supports)
def softmax(n, x):
    if not supports(n, (x,)):
        return torch_norm.softmax(n, x)
    return _launch(n, x, log=False)


@register(N.LogSoftmax, backend="cuda", name="TritonLogSoftmax", tactics=tactics,
          supports=supports)
def log_softmax(n, x):
    if not supports(n, (x,)):
        return torch_norm.log_softmax(n, x)
    return _launch(n, x, log=True)
