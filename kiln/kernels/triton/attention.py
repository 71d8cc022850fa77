"""Triton flash attention (forward): ``softmax(q @ k^T * scale + mask) @ v`` in one kernel.

One program per (BLOCK_M query rows, batch x head); it walks the keys BLOCK_N at a time with an
online softmax (running max and sum, fp32), so the [Sq, Sk] score matrix never reaches memory.
q/k/v/mask are read through their strides: the packed [B, S, H*D] layout, k given transposed and
masks broadcast over batch or heads cost no copy, nor does a merged projection's output
(``qkv_split``: q, k and v are views of it). Masks are additive floats or booleans (True:
attend, as SDPA reads them; HF's SDPA exports build a boolean key-padding mask, which cuDNN's
SDPA took 2x longer over than with no mask at BERT-base b64; a mask the same for every query,
such as that one, is read as one row of keys per block). Causal is top-left aligned (key
j <= query i), as kiln's Attention op defines it. Tactic: ``{"BLOCK_M", "BLOCK_N",
"num_warps", "num_stages"}``. fp32 inputs and other layouts run the PyTorch kernel (SDPA).
"""

from __future__ import annotations

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import fused_transformer as torch_ft
from kiln.kernels.triton.common import HALF, launch, next_pow2, on_device, tactic_of
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import fused_transformer as FT
from kiln.ops.rules import broadcast_ints

_LOG2E = 1.4426950408889634


@jit
def _attn_kernel(Q, K, V, Mask, Out, qk_scale, Sq, Sk, H, D, DV,
                 s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                 s_mb, s_mh, s_mm, s_mn, s_ob, s_oh, s_om, s_od,
                 HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 MASK_KEYS: tl.constexpr = False):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D), other=0.0)
    k_base = K + b * s_kb + h * s_kh + offs_d[:, None] * s_kd
    v_base = V + b * s_vb + h * s_vh + offs_dv[None, :] * s_vd
    m_base = Mask + b * s_mb + h * s_mh + offs_m[:, None] * s_mm
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kt = tl.load(k_base + cols[None, :] * s_kn,
                     mask=(cols[None, :] < Sk) & (offs_d[:, None] < D), other=0.0)
        s = tl.dot(q, kt) * qk_scale  # log2 units: exp2 below
        keep = cols[None, :] < Sk
        if HAS_MASK and MASK_KEYS:  # one mask row for every query (key padding): BLOCK_N
            k_ptrs = Mask + b * s_mb + h * s_mh + cols * s_mn  # values, broadcast over rows
            if MASK_BOOL:
                keep = keep & (tl.load(k_ptrs, mask=cols < Sk, other=1) != 0)[None, :]
            else:
                s += (tl.load(k_ptrs, mask=cols < Sk, other=0.0).to(tl.float32)
                      * 1.4426950408889634)[None, :]
        elif HAS_MASK:
            m_ptrs = m_base + cols[None, :] * s_mn
            m_ok = (offs_m[:, None] < Sq) & (cols[None, :] < Sk)
            if MASK_BOOL:  # uint8 view of a bool mask: 0 masks the key out
                keep = keep & (tl.load(m_ptrs, mask=m_ok, other=1) != 0)
            else:
                s += tl.load(m_ptrs, mask=m_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row masked so far
        p = tl.exp2(s - m_safe[:, None])
        scale_old = tl.exp2(m_i - m_safe)
        l_i = l_i * scale_old + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * s_vn,
                    mask=(cols[:, None] < Sk) & (offs_dv[None, :] < DV), other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * scale_old[:, None])
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a fully masked row: zeros, as SDPA
    o_ptrs = Out + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_dv[None, :] * s_od
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < Sq) & (offs_dv[None, :] < DV))


def _bhsd(n, q, k, v):
    """q, k, v as [B, H, S, D] views (k not transposed), or None when the layout is not one
    this kernel reads."""
    h = n.a.num_heads
    if h:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.shape[-1] % h or v.shape[-1] % h:
            return None
        return tuple(t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))
    if not 2 <= q.dim() <= 4 or k.dim() != q.dim() or v.dim() != q.dim():
        return None
    k = k.transpose(-1, -2)
    lead = q.shape[:-2]
    try:
        k = k.expand(*lead, *k.shape[-2:])
        v = v.expand(*lead, *v.shape[-2:])
    except RuntimeError:
        return None
    while q.dim() < 4:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    return q, k, v


def _inputs(n, inputs):
    """(q, k, v, mask), q/k/v as views of the merged projection where ``qkv_split`` says so."""
    q = inputs[0]
    k = inputs[1] if len(inputs) > 1 else None
    v = inputs[2] if len(inputs) > 2 else None
    mask = inputs[3] if len(inputs) > 3 else None
    split = n.a.qkv_split
    if split and isinstance(q, torch.Tensor) and q.shape[-1] == sum(split):
        q, k, v = q.split(list(split), dim=-1)
    return q, k, v, mask


def supports(n, inputs) -> bool:
    q, k, v, mask = _inputs(n, inputs)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if not (on_device(q, k, v, mask) and q.dtype in HALF and k.dtype == v.dtype == q.dtype):
        return False
    views = _bhsd(n, q, k, v)
    if views is None:
        return False
    q4, k4, v4 = views
    if q4.shape[-1] != k4.shape[-1] or k4.shape[-2] != v4.shape[-2] or q4.shape[-1] > 256 \
            or v4.shape[-1] > 256 or 0 in q4.shape or k4.shape[-2] == 0:
        return False
    if mask is not None:
        if not (mask.dtype.is_floating_point or mask.dtype == torch.bool) or mask.dim() > 4:
            return False
        try:  # not torch.broadcast_shapes (its first call imports torch's symbolic shapes)
            broadcast_ints(mask.shape, (*q4.shape[:-1], k4.shape[-2]))
        except ValueError:
            return False
    return True


def tactics(n, inputs) -> list[dict]:
    q4, k4, _ = _bhsd(n, *_inputs(n, inputs)[:3])
    sq, d = q4.shape[-2], q4.shape[-1]
    out = []
    for bm, bn, w, s in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                         (64, 128, 4, 2), (64, 32, 4, 4), (128, 32, 4, 3), (32, 32, 2, 3)):
        if bm > max(32, 2 * next_pow2(sq)) or (d > 128 and bn > 64):
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s})
    return out


def flash_attention(n, q, k, v, mask=None, causal=False, scale=None):
    """Attention over [B, H, S, D] views (any strides); returns [B, H, Sq, Dv] in a fresh
    tensor whose memory is laid out [B, Sq, H, Dv] (what the packed layout wants back)."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    default = {"BLOCK_M": 64 if sq <= 64 else 128, "BLOCK_N": 64, "num_warps": 4,
               "num_stages": 3}
    t = tactic_of(n, default)
    o = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device).transpose(1, 2)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)  # same bytes; Triton reads uint8, not i1 storage
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(b, h, sq, sk)
        ms = list(m4.stride())  # 0 on the broadcast dims
    else:
        m4, ms = q, [0, 0, 0, 0]
    scale = float(scale) if scale is not None else d ** -0.5
    grid = (cdiv(sq, t["BLOCK_M"]), b * h)
    launch(_attn_kernel, grid, q, k, v, m4, o, scale * _LOG2E, sq, sk, h, d, dv,
           *q.stride(), *k.stride(), *v.stride(), *ms, *o.stride(),
           HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
           CAUSAL=bool(causal), MASK_KEYS=mask is not None and ms[2] == 0, BLOCK_M=t["BLOCK_M"],
           BLOCK_N=t["BLOCK_N"], BLOCK_D=max(16, next_pow2(d)), BLOCK_DV=max(16, next_pow2(dv)),
           num_warps=t["num_warps"], num_stages=t["num_stages"])
    return o


@register(FT.Attention, backend="cuda", name="TritonFlashAttention", tactics=tactics,
          supports=supports)
def attention(n, q, k=None, v=None, mask=None):
    if not supports(n, (q, k, v, mask)):
        return torch_ft.attention(n, q, k, v, mask)
    q, k, v, mask = _inputs(n, (q, k, v, mask))
    q4, k4, v4 = _bhsd(n, q, k, v)
    o = flash_attention(n, q4, k4, v4, mask, bool(n.a.causal), n.a.scale)
    if n.a.num_heads:
        return o.transpose(1, 2).flatten(-2)
    return o.reshape(*q.shape[:-1], v4.shape[-1])
