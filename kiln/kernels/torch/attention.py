"""PyTorch kernels: Attention (SDPA fast path + explicit path) and the other attention ops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.ops import attention as A

NEG_INF = float("-inf")
_HALF = (torch.float16, torch.bfloat16)


def split_heads(x, heads: int):
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hd = x.shape
    return x.reshape(b, s, heads, hd // heads).transpose(1, 2)


def merge_heads(x):
    """(B, H, S, D) -> (B, S, H*D)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def _mask_bias(mask, skv: int, dt):
    """attn_mask as an additive bias of dtype ``dt``, padded to ``skv`` keys (pad = masked)."""
    pad = skv - mask.shape[-1]
    if mask.dtype == torch.bool:
        if pad > 0:
            mask = F.pad(mask, (0, pad), value=False)
        zero = torch.zeros((), dtype=dt)
        return torch.where(mask, zero, torch.full((), NEG_INF, dtype=dt))
    mask = mask.to(dt)
    return F.pad(mask, (0, pad), value=NEG_INF) if pad > 0 else mask


def _structural_allowed(n, sq: int, skv: int, offset, nonpad):
    """Boolean (…, Sq, Skv) set of keys allowed by is_causal, the sliding window and
    nonpad_kv_seqlen, or None when none of them applies. ``offset`` is the absolute position
    of query 0: an int, or a (B,) tensor for an external cache."""
    a = n.a
    left = -1 if a.left_window_size is None else a.left_window_size
    right = -1 if a.right_window_size is None else a.right_window_size
    allowed = None
    if a.is_causal or left >= 0 or right >= 0:
        i = torch.arange(sq).reshape(sq, 1)
        if isinstance(offset, torch.Tensor):
            i = i + offset.reshape(-1, 1, 1, 1)  # (B, 1, Sq, 1): per-batch frontier
        else:
            i = i + offset
        diff = i - torch.arange(skv)  # query position minus key position
        allowed = torch.ones_like(diff, dtype=torch.bool)
        if a.is_causal:
            allowed = allowed & (diff >= 0)
        if left >= 0:
            allowed = allowed & (diff <= left)
        if right >= 0:
            allowed = allowed & (-diff <= right)
    if nonpad is not None:
        pad_ok = torch.arange(skv) < nonpad.reshape(-1, 1, 1, 1)
        allowed = pad_ok if allowed is None else allowed & pad_ok
    return allowed


def attention_bias(n, q, mask, past_k, nonpad, skv: int):
    """The additive bias (broadcastable to (B, H, Sq, Skv)) or None when nothing masks."""
    sq, dt = q.shape[2], q.dtype
    if past_k is not None:
        offset = past_k.shape[2]
    elif nonpad is not None:
        offset = nonpad.to(torch.int64) - sq
    else:
        offset = 0
    nonpad = None if nonpad is None else nonpad.to(torch.int64)
    bias = None if mask is None else _mask_bias(mask, skv, dt)
    allowed = _structural_allowed(n, sq, skv, offset, nonpad)
    if allowed is not None:
        structural = torch.where(allowed, torch.zeros((), dtype=dt),
                                 torch.full((), NEG_INF, dtype=dt))
        bias = structural if bias is None else bias + structural
    return bias


def _gqa(k, hq: int):
    hkv = k.shape[1]
    if hkv != hq and hq % hkv == 0:
        return k.repeat_interleave(hq // hkv, dim=1)
    return k


def _softcap(x, cap: float):
    return torch.tanh(x / cap) * cap if cap and cap > 0 else x


def _softmax(x):
    if x.dtype not in _HALF:
        return torch.softmax(x, dim=-1)
    # ONNX rounds exp() to the storage type before normalising; torch's fused half softmax
    # does not, which is off by an ulp often enough to matter
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _explicit(n, q, k, v, bias, scale: float):
    """Matmul-softmax-matmul, for everything SDPA cannot express. Returns (Y, qk_output)."""
    a, dt = n.a, q.dtype
    k, v = _gqa(k, q.shape[1]), _gqa(v, q.shape[1])
    s = torch.tensor(math.sqrt(scale), dtype=torch.float64).to(dt)  # as ONNX: Q and K by sqrt
    qk = torch.matmul(q * s, (k * s).transpose(-1, -2))
    raw = qk
    qk = _softcap(qk, a.softcap)
    logits = qk if bias is None else qk + bias
    mode = a.qk_matmul_output_mode or 0
    if a.softmax_precision:
        logits = logits.to(TORCH_DTYPE[DType.from_onnx(a.softmax_precision)])
    probs = _softmax(logits)
    if bias is not None:
        # a query row with no allowed key yields zeros (not NaN), decided on the bias alone
        dead = torch.isneginf(bias.amax(dim=-1, keepdim=True))
        probs = torch.where(dead, torch.zeros((), dtype=probs.dtype), probs)
    y = torch.matmul(probs.to(dt), v)
    extra = (raw, qk, logits if bias is not None else qk, probs)[min(mode, 3)]
    return y, extra.to(dt)


def _fast_ok(n, q, bias) -> bool:
    """SDPA fits unless: qk_matmul_output is wanted, softcap is on, softmax_precision asks for
    another dtype, the dtype is half (SDPA softmaxes in float32, ONNX in the storage type), or
    a query row is fully masked (SDPA gives NaN there, ONNX zeros)."""
    a = n.a
    if n.n_out > 3 or (a.softcap and a.softcap > 0) or q.dtype in _HALF:
        return False
    if a.softmax_precision and TORCH_DTYPE[DType.from_onnx(a.softmax_precision)] != q.dtype:
        return False
    return bias is None or not torch.isneginf(bias.amax(dim=-1)).any()


def _plain_causal(n, mask, past_k, nonpad) -> bool:
    """is_causal with offset 0 and nothing else: SDPA's own (top-left) causal mask."""
    a = n.a
    return bool(a.is_causal) and mask is None and past_k is None and nonpad is None and (
        (a.left_window_size is None or a.left_window_size < 0)
        and (a.right_window_size is None or a.right_window_size < 0))


@register(A.Attention)
def attention(n, q, k, v, mask=None, past_k=None, past_v=None, nonpad=None):
    a = n.a
    three_d = q.dim() == 3
    if three_d:
        q, k, v = (split_heads(q, a.q_num_heads), split_heads(k, a.kv_num_heads),
                   split_heads(v, a.kv_num_heads))
    if past_k is not None:
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    scale = a.scale if a.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    causal_only = _plain_causal(n, mask, past_k, nonpad)
    bias = None if causal_only else attention_bias(n, q, mask, past_k, nonpad, k.shape[2])
    qk = None
    if _fast_ok(n, q, bias):
        hq, hkv = q.shape[1], k.shape[1]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, is_causal=causal_only, scale=scale,
            enable_gqa=hq != hkv and hq % hkv == 0)
    else:
        if causal_only:
            bias = attention_bias(n, q, mask, past_k, nonpad, k.shape[2])
        y, qk = _explicit(n, q, k, v, bias, scale)
    if three_d:
        y = merge_heads(y)
    return (y, k, v, qk)[:max(n.n_out, 1)]
