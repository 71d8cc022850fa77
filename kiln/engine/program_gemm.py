"""Planners of the transformer layers' program records: GEMMs with a constant weight
(``MatMul``, ``FusedMatMul`` and its LayerNorm form, ``Gemm``, ``FusedGemm``),
``LayerNormalization``, ``RMSNormalization`` and fused ``Attention``, as the C interpreter's
GEMM, LayerNorm, RMSNorm and attention records (those :mod:`kiln.engine.chains` emits, and an
RMSNorm one), so that a transformer's layers run in the program instead of stopping it once per
layer.

A decode step of a small model is ~200 layers of a few microseconds each; each torch record
costs the return to Python, the kernel's wrapper and torch's dispatch (tens of microseconds on a
busy machine, a GEMM's OpenMP region far more), which was most of its time. The records compute
what the chains do: kiln's GEMM (its epilogue: bias, residual, activation), kiln's LayerNorm,
kiln's attention kernel (any strides with contiguous rows, grouped key/value heads, a broadcast
additive mask, the causal flag). An input whose rows do not collapse to one stride (a strided
view a Reshape or Transpose left), or an attention operand whose head dim is not contiguous, is
copied into a layout they take first; what they cannot take at all (a broadcasting residual, a
computed weight) leaves the step to its torch record.
"""

from __future__ import annotations

import torch

from kiln import native
from kiln.engine.program import Val, _Decline, contiguous_strides
from kiln.engine.program_ops import emit_copy
from kiln.ops import fused_conv as FC
from kiln.ops import fused_transformer as FT
from kiln.ops import nn as NN
from kiln.runtime import host
from kiln.settings import SETTINGS

OP_GEMM, OP_LN, OP_ATTN, OP_RMS = 1, 2, 3, 9  # chain.c's record kinds (8: OP_RNN)


def _rows(v: Val | None):
    """(rows, row stride) of ``v`` seen as a matrix of its last dim, when its last dim is
    contiguous and its leading dims collapse to one stride; None otherwise."""
    if v is None or not v.shape:
        return None
    if len(v.shape) == 1:
        return 1, v.shape[0]
    if v.strides[-1] != 1 and v.shape[-1] != 1:
        return None
    lead = [(d, s) for d, s in zip(v.shape[:-1], v.strides[:-1]) if d != 1]
    rows = 1
    for d, _ in lead:
        rows *= d
    if not lead:
        return rows, v.shape[-1]
    for (_, s), (d1, s1) in zip(lead, lead[1:]):
        if s != s1 * d1:
            return None
    return rows, lead[-1][1]


def _row_major(pc, v: Val):
    """(``v``, its (rows, row stride)), or where its rows do not collapse (a strided view that
    a Reshape or Transpose left) a contiguous copy of it and the copy's. Called once the
    planner has checked everything else: it emits the copy."""
    r = _rows(v)
    if r is not None:
        return v, r
    c = pc.alloc(v.shape)
    if not emit_copy(pc, v, c):
        raise _Decline  # (past the copy record's 6 dims: program values have at most 6)
    return c, _rows(c)


def _unit_stride(pc, v: Val, dim: int) -> Val | None:
    """``v`` where its ``dim`` has stride 1 (or size 1), else a copy laid out so: the other dims
    in their order outside it."""
    if v.strides[dim] == 1 or v.shape[dim] == 1:
        return v
    order = [d for d in range(len(v.shape)) if d != dim] + [dim]
    dense = contiguous_strides([v.shape[d] for d in order])
    strides = [0] * len(v.shape)
    for d, s in zip(order, dense):
        strides[d] = s
    c = pc.alloc(v.shape, tuple(strides))
    return c if emit_copy(pc, v, c) else None


def _const_f32(pc, st, i: int, shape: tuple | None = None):
    """Input ``i`` as a contiguous float32 CPU constant (of ``shape``, when given); None where
    it is absent, False where it is computed or another kind of tensor."""
    if len(st.ins) <= i or st.ins[i] < 0:
        return None
    c = pc.consts.get(st.ins[i])
    if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or c.device.type != "cpu" \
            or (shape is not None and tuple(c.shape) != shape):
        return False
    return c.contiguous()


def _packed(pc, key, w: torch.Tensor, src: torch.Tensor) -> native.PackedWeight:
    """The kiln GEMM packing of ``w`` ([K, N], made from the constant ``src``), once per
    ``key`` (the weight's slot and how it was made from it) and constant: plans keyed on
    input values renumber slots (an inlined If branch's constants), so the slot alone could
    name another weight in another plan."""
    key = (key, src.data_ptr(), tuple(src.shape))
    pw = pc.packed.get(key)
    if pw is None:
        pw = pc.packed[key] = native.PackedWeight(w)
        host.release_pages(src)  # packed: the weight's engine-file pages can go
    return pw


def _residual(st, ins, i: int, shape: tuple):
    """Input ``i``, an optional residual of the product's ``shape``: the value, None where
    absent, False where the record cannot take it (computed outside the program,
    broadcasting)."""
    if len(st.ins) <= i or st.ins[i] < 0:
        return None
    r = ins[i]
    return False if r is None or r.shape != shape else r


def _emit_gemm(pc, x: Val, pw, bias, res: Val | None, shape: tuple, act: str,
               alpha, beta) -> tuple[Val, int]:
    """``y = act(x @ w + bias + r)``: one GEMM record into a new value of ``shape`` (``x`` and
    ``r`` copied contiguous first where their rows do not collapse); (y, its rows)."""
    n = shape[-1]
    k = x.shape[-1]
    x, (rows, lda) = _row_major(pc, x)
    ldr = 0
    if res is not None:
        res, (_, ldr) = _row_major(pc, res)
    y = pc.alloc(shape)
    lo, hi = native._epilogue_params(act, alpha, beta)
    rec = [OP_GEMM, rows, n, k]
    pc.put(rec, x)
    rec += [lda, pc.fixed(pw.data), -1 if bias is None else pc.fixed(bias)]
    pc.put(rec, res)
    rec.append(ldr)
    pc.put(rec, y)
    rec += [n, native.ACTIVATIONS[act], pc.fparam(lo, hi)]
    pc.emit(rec)
    return y, rows


def _gemm_ok() -> bool:
    """(A step that runs another kernel than its op's default is never planned: the program
    checks that for every planner.)"""
    return native.available and SETTINGS.cpu_linear in ("", "kiln")


def _gemm(pc, st, ins, outs):
    """MatMul / FusedMatMul / FusedMatMulLayerNorm of a value by a constant [K, N] weight:
    ``y = act(x @ w + bias + r)`` (then the LayerNorm) as a GEMM record (and a LayerNorm
    record in place on its result)."""
    if not _gemm_ok() or len(outs) != 1:
        return None
    op, x = st.node.op, ins[0]
    fused = op is not NN.MatMul
    w = _const_f32(pc, st, 1)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or x is None or len(x.shape) < 2 \
            or x.shape[-1] != w.shape[0]:
        return None
    n = w.shape[1]
    a = st.node.attrs if fused else None
    act = a.activation if fused else ""
    bias = _const_f32(pc, st, 2, (n,)) if fused else None
    shape = outs[0].shape
    res = _residual(st, ins, 3, shape) if fused else None
    if act not in native.ACTIVATIONS or bias is False or res is False \
            or shape != x.shape[:-1] + (n,):
        return None
    ln = None
    if op is FC.FusedMatMulLayerNorm:
        ln = (_const_f32(pc, st, 4, (n,)), _const_f32(pc, st, 5, (n,)))
        if not isinstance(ln[0], torch.Tensor) or ln[1] is False:
            return None
    pw = _packed(pc, st.ins[1], w, w)
    y, rows = _emit_gemm(pc, x, pw, bias, res, shape, act, a.alpha if fused else None,
                         a.beta if fused else None)
    if ln is not None:
        _emit_ln(pc, y, y, rows, n, ln[0], ln[1], a.epsilon)
    return [y]


def _gemm2d(pc, st, ins, outs):
    """ONNX Gemm and FusedGemm of a [M, K] value (transA 0) by a constant B (either
    transB): ``act(alpha x @ B + beta C + r)`` with C a constant row (or scalar) as a GEMM
    record; alpha and beta (plain Gemm) are folded into the packed weight and the bias."""
    if not _gemm_ok() or len(outs) != 1:
        return None
    a, x = st.node.attrs, ins[0]
    fused = st.node.op is FC.FusedGemm
    b = _const_f32(pc, st, 1)
    if a.transA or not isinstance(b, torch.Tensor) or b.dim() != 2 or x is None \
            or len(x.shape) != 2:
        return None
    w = b.t() if a.transB else b
    k, n = w.shape
    alpha = 1.0 if fused or a.alpha is None else float(a.alpha)
    beta = 1.0 if fused or a.beta is None else float(a.beta)
    c = _const_f32(pc, st, 2)
    if c is False or x.shape[1] != k or outs[0].shape != (x.shape[0], n) or (
            c is not None and (c.numel() not in (1, n) or (c.dim() == 2 and c.shape[0] != 1)
                               or c.dim() > 2)):
        return None
    bias = None if c is None else (c.reshape(-1).expand(n) * beta).contiguous()
    res = _residual(st, ins, 3, outs[0].shape) if fused else None
    act = a.activation if fused else ""
    if res is False or act not in native.ACTIVATIONS:
        return None
    pw = _packed(pc, (st.ins[1], bool(a.transB), alpha), (w * alpha) if alpha != 1 else w, b)
    return [_emit_gemm(pc, x, pw, bias, res, outs[0].shape, act, a.alpha if fused else None,
                       a.beta if fused else None)[0]]


def _emit_ln(pc, x: Val, y: Val, rows: int, n: int, scale, bias, eps: float,
             kind: int = OP_LN) -> None:
    rec = [kind, rows, n]
    pc.put(rec, x)
    rec.append(_rows(x)[1])
    pc.put(rec, y)
    rec += [n, pc.fixed(scale), -1 if bias is None else pc.fixed(bias), pc.fparam(eps)]
    pc.emit(rec)


def _layer_norm(pc, st, ins, outs):
    """LayerNormalization over the last axis with constant scale and bias: a LayerNorm
    record."""
    a, x = st.node.attrs, ins[0]
    if not native.available or len(outs) != 1 or x is None or not x.shape or (
            a.axis is not None and a.axis not in (-1, len(x.shape) - 1)):
        return None
    n = x.shape[-1]
    scale, bias = _const_f32(pc, st, 1, (n,)), _const_f32(pc, st, 2, (n,))
    if not isinstance(scale, torch.Tensor) or bias is False or outs[0].shape != x.shape:
        return None
    x, xr = _row_major(pc, x)
    y = pc.alloc(x.shape)
    _emit_ln(pc, x, y, xr[0], n, scale, bias, 1e-5 if a.epsilon is None else float(a.epsilon))
    return [y]


def _rms_norm(pc, st, ins, outs):
    """RMSNormalization over the last axis with a constant scale: an RMSNorm record."""
    a, x = st.node.attrs, ins[0]
    if not native.available or len(outs) != 1 or x is None or not x.shape or (
            a.axis is not None and a.axis not in (-1, len(x.shape) - 1)):
        return None
    scale = _const_f32(pc, st, 1, (x.shape[-1],))
    if not isinstance(scale, torch.Tensor) or outs[0].shape != x.shape:
        return None
    x, xr = _row_major(pc, x)
    y = pc.alloc(x.shape)
    _emit_ln(pc, x, y, xr[0], x.shape[-1], scale, None,
             1e-5 if a.epsilon is None else float(a.epsilon), OP_RMS)
    return [y]


def _bstrides(v: Val, shape: tuple) -> list:
    k = len(shape) - len(v.shape)
    return [0 if d < k or v.shape[d - k] == 1 else v.strides[d - k] for d in range(len(shape))]


def _split_heads(a, q: Val, ins):
    """For ``num_heads`` > 0: the dims (B, H, Hkv, Sq, Skv, D, Dv) and, for q, k and v, (value,
    column offset, batch, head and row strides) of [B, S, H*D] values; None where a value is
    missing, not 3-D or its rows are not contiguous."""
    h = a.num_heads
    if a.qkv_split:
        dq, dk, dvt = a.qkv_split
        vals, offs = (q, q, q), (0, dq, dq + dk)
    else:
        vals, offs = tuple(ins[:3]), (0, 0, 0)
        if any(v is None for v in vals):
            return None
        dq, dk, dvt = (v.shape[-1] for v in vals)
    if any(len(v.shape) != 3 or v.strides[2] != 1 for v in vals) or dq != dk or dq % h \
            or dvt % h:
        return None
    b, sq = q.shape[:2]
    skv = vals[1].shape[1]
    if vals[1].shape[0] != b or vals[2].shape[:2] != (b, skv):
        return None
    d, dv = dq // h, dvt // h
    parts = [(v, off, [v.strides[0], width, v.strides[1]])
             for v, off, width in zip(vals, offs, (d, d, dv))]
    return (b, h, h, sq, skv, d, dv), parts


def _attention(pc, st, ins, outs):
    """Attention as the attention record: ``num_heads`` > 0 on [B, S, H*D] values (or one
    merged projection's output with ``qkv_split``), ``num_heads`` == 0 on [B, H, S, D] q and v
    and k given transposed ([B, Hkv, D, Skv]); a float mask broadcast to [B, H, Sq, Skv]."""
    a = st.node.attrs
    if not native.available or len(outs) != 1 or ins[0] is None:
        return None
    q = ins[0]
    mask = ins[3] if len(ins) > 3 else None
    if len(st.ins) > 3 and st.ins[3] >= 0 and mask is None:
        return None  # a mask that is not a float32 program value
    if a.num_heads:
        split = _split_heads(a, q, ins)
        if split is None:
            return None
        (b, h, hkv, sq, skv, d, dv), parts = split
        shape = (b, sq, h * dv)
        ystrides = [sq * h * dv, dv, h * dv]
    else:
        k, v = ins[1], ins[2]
        if k is None or v is None or any(len(t.shape) != 4 for t in (q, k, v)):
            return None
        b, h, sq, d = q.shape
        hkv, skv, dv = k.shape[1], k.shape[3], v.shape[3]
        if k.shape != (b, hkv, d, skv) or v.shape != (b, hkv, skv, dv) or h % hkv:
            return None
        parts = None  # (made once the mask is checked: it may copy)
        shape = (b, h, sq, dv)
        ystrides = list(contiguous_strides(shape)[:3])
    full = (b, h, sq, skv)
    if outs[0].shape != shape or (mask is not None and (len(mask.shape) > 4 or any(
            m not in (1, f) for m, f in zip(mask.shape[::-1], full[::-1])))):
        return None
    if parts is None:  # the head dim read contiguous: a strided view copied so where not
        q, k, v = _unit_stride(pc, q, 3), _unit_stride(pc, ins[1], 2), _unit_stride(pc, v, 3)
        if q is None or k is None or v is None:
            return None
        parts = [(q, 0, list(q.strides[:3])), (k, 0, [k.strides[0], k.strides[1], k.strides[3]]),
                 (v, 0, list(v.strides[:3]))]
    y = pc.alloc(shape)
    rec = [OP_ATTN, b, h, hkv, sq, skv, d, dv]
    for v, off, strides in parts:
        pc.put(rec, v._replace(off=v.off + off))
        rec += strides
    pc.put(rec, mask)
    rec += _bstrides(mask, full) if mask is not None else [0, 0, 0, 0]
    rec += [0 if a.causal else -1, pc.fparam(float(a.scale))]
    pc.put(rec, y)
    rec += ystrides
    pc.emit(rec)
    return [y]


PLANNERS = {NN.MatMul: _gemm, FC.FusedMatMul: _gemm, FC.FusedMatMulLayerNorm: _gemm,
            NN.Gemm: _gemm2d, FC.FusedGemm: _gemm2d,
            NN.LayerNormalization: _layer_norm, NN.RMSNormalization: _rms_norm,
            FT.Attention: _attention}
