"""Attention-style ops: Attention, RotaryEmbedding, KV-cache updates, linear/flex attention."""

from __future__ import annotations

import sympy

from kiln.ir.opdef import InferCtx
from kiln.ir.types import as_dim
from kiln.ops.rules import tensor
from kiln.ops.schema import onnx_op


def _div(a, b):
    """Symbolic-safe a / b for dims (None when either is unknown or b is not given)."""
    if a is None or not b:
        return None
    if isinstance(a, int):
        return a // b
    return as_dim(sympy.floor(a / b))


def _add(a, b):
    return None if a is None or b is None else as_dim(a + b)


def _dim(shape, i):
    if shape is None or not -len(shape) <= i < len(shape):
        return None
    return shape[i]


def attention_rule(ctx: InferCtx):
    """Y, present_key, present_value, qk_matmul_output for 3-D or 4-D Q/K/V."""
    q, k, v = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    dt, a = ctx.dtype(0), ctx.attrs
    rank = None if q is None else len(q)
    b = _dim(q, 0)
    if rank == 3:
        hq, hkv, sq = a.q_num_heads, a.kv_num_heads, _dim(q, 1)
        head, v_head = _div(_dim(k, 2), hkv), _div(_dim(v, 2), hkv)
        y = (b, sq, None if v_head is None or hq is None else as_dim(v_head * hq))
        skv = _dim(k, 1)
    elif rank == 4:
        hq, sq, hkv = q[1], q[2], _dim(k, 1)
        head, v_head, skv = _dim(k, 3), _dim(v, 3), _dim(k, 2)
        y = (b, hq, sq, v_head)
    else:
        return [tensor(dt, None), tensor(ctx.dtype(1), None), tensor(ctx.dtype(2), None),
                tensor(dt, None)][:max(ctx.n_out, 1)]
    past = _dim(ctx.shape(4), 2) if ctx.has(4) else 0
    total = _add(past, skv)
    out = [tensor(dt, y),
           tensor(ctx.dtype(1), (b, hkv, total, head)),
           tensor(ctx.dtype(2), (b, hkv, total, v_head)),
           tensor(dt, (b, hq, sq, total))]
    return out[:max(ctx.n_out, 1)]


def _same(ctx: InferCtx):
    return [ctx.type(0)]


def causal_conv_rule(ctx: InferCtx):
    x, w = ctx.shape(0), ctx.shape(1)
    k = _dim(w, 2)
    state = None if x is None else (x[0], x[1], None if k is None else k - 1)
    return [ctx.type(0), tensor(ctx.dtype(0), state)]


def linear_attention_rule(ctx: InferCtx):
    q, k, v = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    a = ctx.attrs
    dk, dv = _div(_dim(k, 2), a.kv_num_heads), _div(_dim(v, 2), a.kv_num_heads)
    hq = a.q_num_heads
    y = None if q is None else (q[0], q[1], None if dv is None or not hq else as_dim(dv * hq))
    sdt = ctx.dtype(3) if ctx.has(3) else ctx.dtype(0)
    return [tensor(ctx.dtype(0), y),
            tensor(sdt, None if q is None else (q[0], a.kv_num_heads, dk, dv))]


def flex_attention_rule(ctx: InferCtx):
    q, v = ctx.shape(0), ctx.shape(2)
    y = None if q is None else (q[0], q[1], q[2], _dim(v, 3))
    return [tensor(ctx.dtype(0), y)]


Attention = onnx_op("Attention", attention_rule)
RotaryEmbedding = onnx_op("RotaryEmbedding", _same)
TensorScatter = onnx_op("TensorScatter", _same)
SwiGLU = onnx_op("SwiGLU", _same)
CausalConvWithState = onnx_op("CausalConvWithState", causal_conv_rule)
LinearAttention = onnx_op("LinearAttention", linear_attention_rule)
FlexAttention = onnx_op("FlexAttention", flex_attention_rule, domain="ai.onnx.preview")
