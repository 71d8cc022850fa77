"""PyTorch kernels: RotaryEmbedding, TensorScatter, SwiGLU, CausalConvWithState,
LinearAttention and FlexAttention (imported by kiln.kernels.torch.attention)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.attention import merge_heads, split_heads
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.ops import attention as A


@register(A.RotaryEmbedding)
def rotary_embedding(n, x, cos, sin, position_ids=None):
    a = n.a
    shape = x.shape
    if x.dim() == 4:
        x = x.transpose(1, 2)  # (B, H, S, D) -> (B, S, H, D)
    else:
        x = x.reshape(shape[0], shape[1], a.num_heads, -1)
    rd = a.rotary_embedding_dim or x.shape[-1]
    xr, rest = x[..., :rd], x[..., rd:]
    if position_ids is not None:
        pos = position_ids.to(torch.int64)
        cos, sin = cos[pos], sin[pos]  # (B, S, rd/2)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    if a.interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if a.interleaved:
        rot = torch.stack([real, imag], dim=-1).reshape(xr.shape)
    else:
        rot = torch.cat([real, imag], dim=-1)
    y = torch.cat([rot, rest], dim=-1)
    return y.transpose(1, 2) if len(shape) == 4 else y.reshape(shape)


@register(A.TensorScatter)
def tensor_scatter(n, past, update, write_indices=None):
    axis = n.a.axis + past.dim() if n.a.axis < 0 else n.a.axis
    b, s, cap = past.shape[0], update.shape[axis], past.shape[axis]
    start = (torch.zeros(b, dtype=torch.int64) if write_indices is None
             else write_indices.to(torch.int64))
    pos = start.reshape(b, 1) + torch.arange(s)  # (B, S): cache slot of each update row
    if n.a.mode == "circular":
        pos = pos % cap
    view = [b] + [1] * (past.dim() - 1)
    view[axis] = s
    return torch.scatter(past, axis, pos.reshape(view).expand(update.shape), update)


@register(A.SwiGLU)
def swiglu(n, a, b):
    alpha = 1.0 if n.a.alpha is None else n.a.alpha
    return a * torch.sigmoid(alpha * a) * b


@register(A.CausalConvWithState)
def causal_conv_with_state(n, x, w, bias=None, past=None):
    bsz, ch, _ = x.shape
    k = w.shape[2]
    if past is None:
        past = torch.zeros(bsz, ch, k - 1, dtype=x.dtype)
    padded = torch.cat([past.to(x.dtype), x], dim=2)
    # half-precision conv1d has no CPU kernel everywhere: convolve in float32 for them
    cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = F.conv1d(padded.to(cdt), w.to(cdt), None if bias is None else bias.to(cdt), groups=ch)
    if n.a.activation in ("silu", "swish"):
        y = F.silu(y.to(torch.float32) if cdt != torch.float64 else y)
    elif n.a.activation not in (None, "none"):
        raise ValueError(f"CausalConvWithState: unknown activation {n.a.activation!r}")
    return y.to(x.dtype), padded[:, :, padded.shape[2] - (k - 1):]


def _per_head(t, b: int, steps: int, heads: int, width: int):
    """(B, T, heads*width or heads) packed gate -> (B, heads_or_1, T, width_or_1) float32."""
    last = t.shape[-1]
    if last == heads * width and width != 1:
        return split_heads(t, heads).float()
    return t.reshape(b, steps, last, 1).transpose(1, 2).float()


@register(A.LinearAttention)
def linear_attention(n, q, k, v, past=None, decay=None, beta=None):
    a = n.a
    rule = a.update_rule or "gated_delta"
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ValueError(f"LinearAttention: unknown update_rule {rule!r}")
    hq, hkv = a.q_num_heads, a.kv_num_heads
    b, steps, _ = q.shape
    dk, dv = q.shape[-1] // hq, v.shape[-1] // hkv
    q4, k4, v4 = (split_heads(q, hq).float(), split_heads(k, hkv).float(),
                  split_heads(v, hkv).float())
    gate = _per_head(decay, b, steps, hkv, dk) if "gated" in rule else None
    rate = _per_head(beta, b, steps, hkv, 1) if "delta" in rule else None
    state = (past.float() if past is not None
             else torch.zeros(b, hkv, dk, dv, dtype=torch.float32))
    scale = a.scale if a.scale else 1.0 / math.sqrt(dk)
    group = hq // hkv
    outs = []
    for t in range(steps):  # the recurrence is sequential by definition
        if gate is not None:
            state = state * torch.exp(gate[:, :, t]).unsqueeze(-1)
        vt = v4[:, :, t]
        if rate is not None:
            retrieved = torch.einsum("bhdm,bhd->bhm", state, k4[:, :, t])
            vt = rate[:, :, t] * (vt - retrieved)
        state = state + k4[:, :, t].unsqueeze(-1) * vt.unsqueeze(-2)
        read = state.repeat_interleave(group, dim=1) if group > 1 else state
        outs.append(torch.einsum("bhd,bhdm->bhm", q4[:, :, t], read) * scale)
    y = merge_heads(torch.stack(outs, dim=2)).to(q.dtype)
    return y, state.to(past.dtype if past is not None else q.dtype)


def _flex_dtype(dt, precision):
    if precision:
        return TORCH_DTYPE[DType.from_onnx(precision)]
    return torch.float64 if dt == torch.float64 else torch.float32


@register(A.FlexAttention)
def flex_attention(n, q, k, v, *captured):
    a = n.a
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if hq % hkv:
            raise ValueError(f"FlexAttention: {hq} query heads not a multiple of {hkv}")
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scale = a.scale if a.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.tensor(float(np.sqrt(np.float32(scale))), dtype=q.dtype)
    cdt = _flex_dtype(q.dtype, a.softmax_precision)
    scores = torch.matmul(q * s, (k * s).transpose(-1, -2)).to(cdt)
    caps = captured[max(n.n_in - 3, 0):]
    if a.score_mod is not None:
        scores = n.run_graph(a.score_mod, [scores], caps)[0].to(cdt)
    probs = torch.softmax(scores, dim=-1)
    if a.prob_mod is not None:
        probs = n.run_graph(a.prob_mod, [probs], caps)[0].to(cdt)
    return torch.matmul(probs, v.to(cdt)).to(v.dtype)
