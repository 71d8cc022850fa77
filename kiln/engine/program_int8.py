"""INT8 layers (``Int8MatMul``, ``Int8MatMulQDQ``) whose CPU tactic at the traced shape is
kiln's qgemm, as one qgemm record of the native program: the input quantized in C (by the
layer's x_scale/x_zero, or a dynamic layer's own range on every run), exact int32 products on
the weight the tactic packed, and the epilogue (dequantize, bias, residual, activation; or
QLinearMatMul's requantization) in the same call. A layer that took FBGEMM or oneDNN stays a
torch record, so that planned runs compute what the traced one did; so does a layout the
record cannot take (a broadcast residual). ``QuantizeDequantize`` becomes an elementwise
record, ``QLinearMatMulQDQ`` (two activations) a record of kiln_qbmm_qdq, which reads its
operands at any strides (a transposed key), and ``DynamicConvInteger`` a record of
kiln_dq_qconv (qconv.c: the input's DynamicQuantizeLinear and the integer convolution in one
call) where the traced run took qconv.
"""

from __future__ import annotations

import math

import torch

from kiln import native
from kiln.engine.program import contiguous_strides, is_contiguous
from kiln.engine.program_linear import _rows
from kiln.engine.program_ops import _dense_like, emit_pw
from kiln.ops import int8 as I8

OP_QGEMM, OP_QBMM, OP_DQCONV = 11, 12, 13  # chain.c's record kinds
_CPU = torch.device("cpu")


def _int8(pc, st, ins, outs):
    x = ins[0] if ins else None
    if x is None or len(outs) != 1 or not native.available or len(x.shape) < 2:
        return None
    cache = st.call.cache
    if (cache.get("lin_tactics") or {}).get(tuple(x.shape)) != "qgemm":
        return None
    w = cache.get("w_qgemm")
    a = st.node.attrs
    qdq = st.node.op is I8.Int8MatMulQDQ
    ws = cache.get(("mult", _CPU)) if qdq else cache.get("w_scale_qgemm")
    if w is None or ws is None:
        return None
    shape = tuple(outs[0].shape)
    if x.shape[-1] != w.k or shape != (*x.shape[:-1], w.n) or math.prod(shape) == 0:
        return None
    bias = None
    if not qdq and len(st.ins) > 3 and st.ins[3] >= 0:
        bias = cache.get("b_qgemm")
        if bias is None:
            return None
    r = ins[4] if not qdq and len(ins) > 4 else None
    if not qdq and len(st.ins) > 4 and st.ins[4] >= 0 and (r is None or r.shape != shape):
        return None  # a constant or broadcast residual: the torch record's
    x, ldx = _rows(pc, x)
    ldr = 0
    if r is not None:
        r, ldr = _rows(pc, r)
    ws = ws.reshape(-1).contiguous()
    for t in (w.packed, w.colsum, ws):
        pc.keep.append(t)
    y = pc.alloc(shape, contiguous_strides(shape))
    if qdq:
        lo, hi = (-128, 127) if a.y_signed else (0, 255)
        act, ep = native.QACT_REQUANT, (0.0, 0.0, a.y_scale, a.y_zero, lo, hi)
    else:
        act = native.ACTIVATIONS[a.activation]
        ep = (*native._epilogue_params(a.activation, a.alpha, a.beta), 0.0, 0.0, 0.0, 0.0)
    rec = [OP_QGEMM, w.code, math.prod(shape[:-1]), w.n, w.k]
    pc.put(rec, x)
    rec += [ldx, pc.fparam(a.x_scale), a.x_zero, pc.fixed(w.packed), pc.fixed(w.colsum),
            pc.fixed(ws), ws.numel(), -1 if bias is None else pc.fixed(bias)]
    pc.put(rec, r)
    rec.append(ldr)
    pc.put(rec, y)
    rec += [w.n, act, pc.fparam(*ep), 0]
    pc.emit(rec)
    return [y]


def _quantize_dequantize(pc, st, ins, outs):
    """QuantizeDequantize (a Q/DQ pair kept between float ops) as the elementwise record of
    the C kernel its CPU kernel calls (the same float32 steps)."""
    x = ins[0] if ins else None
    if x is None or len(outs) != 1:
        return None
    a = st.node.attrs
    code = native.POINTWISE["QuantizeDequantizeS8" if a.signed else "QuantizeDequantizeU8"]
    shape = outs[0].shape
    y = pc.alloc(shape, _dense_like(shape, x))
    if not emit_pw(pc, code, y, x, None, a.scale, float(a.zero)):
        return None
    return [y]


def _qbmm(pc, st, ins, outs):
    """QLinearMatMulQDQ as one kiln_qbmm_qdq record (qgemm.c): the operands' codes, exact
    products and requantization in C, the float32 values into a new contiguous value."""
    from kiln.kernels.torch.int8 import qlinear_mult

    if len(ins) != 2 or any(v is None for v in ins) or len(outs) != 1 or not native.available:
        return None
    a, b = ins
    geo = native.qbmm_geometry(a.shape, a.strides, b.shape, b.strides)
    shape = tuple(outs[0].shape)
    if geo is None or math.prod(shape) == 0:
        return None
    dims, sa, sb = geo
    if shape[-2:] != (dims[2], dims[3]) or math.prod(shape) != math.prod(dims[:4]):
        return None
    at = st.node.attrs
    qp = native.qbmm_params((at.a_scale, at.a_zero, at.a_signed),
                            (at.b_scale, at.b_zero, at.b_signed),
                            (at.y_scale, at.y_zero, at.y_signed), qlinear_mult(at))
    y = pc.alloc(shape, contiguous_strides(shape))
    m, n = dims[2], dims[3]
    rec = [OP_QBMM, native.qbmm_path(), *dims]
    pc.put(rec, a)
    rec += list(sa)
    pc.put(rec, b)
    rec += list(sb)
    pc.put(rec, y)
    rec += [dims[1] * m * n, m * n, n, pc.fparam(*qp)]
    pc.emit(rec)
    return [y]


def _dq_conv(pc, st, ins, outs):
    """DynamicConvInteger as one kiln_dq_qconv record, where qconv.c takes the layer (the
    kernel's plan for the traced shape) and its input is a contiguous program value."""
    from kiln.kernels.torch.quant_linear import _conv_bias, qconv_plan_for

    x = ins[0] if ins else None
    if x is None or len(outs) != 1 or len(st.ins) < 5 or not is_contiguous(x):
        return None
    w, wz, b, ws = (pc.consts.get(i) if i >= 0 else None for i in st.ins[1:5])
    if not torch.is_tensor(w) or not torch.is_tensor(b) or not torch.is_tensor(ws) or \
            ws.numel() != 1 or b.numel() != w.shape[0] or (st.ins[2] >= 0 and wz is None):
        return None
    plan = qconv_plan_for(tuple(x.shape), torch.uint8, w, wz, st.node.attrs, st.call.cache)
    if plan is None or math.prod(plan.out) != math.prod(outs[0].shape):
        return None
    oc, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, _, a_zero, _ = plan.geo
    bias = _conv_bias(st.call, b)
    pc.keep += [plan, bias]
    shape = tuple(outs[0].shape)
    y = pc.alloc(shape, contiguous_strides(shape))
    rec = [OP_DQCONV, *plan.head]
    pc.put(rec, x)
    rec += [oc, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, pc.fixed(plan.w.codes), a_zero,
            pc.fixed(plan.w.wsum), pc.fixed(bias), pc.fparam(float(ws.float().reshape(())))]
    pc.put(rec, y)
    pc.emit(rec)
    return [y]


def _dyn_matmul(pc, st, ins, outs):
    """DynamicMatMulInteger as one qgemm record (x_scale 0: x's own range; the weight's column
    offset), where the kernel's qgemm path takes the layer."""
    from kiln.kernels.torch.quant_linear import _dyn_qgemm

    x = ins[0] if ins else None
    if x is None or len(outs) != 1 or len(x.shape) < 2 or len(st.ins) < 4:
        return None
    w, wz, ws = (pc.consts.get(i) if i >= 0 else None for i in st.ins[1:4])
    b = pc.consts.get(st.ins[4]) if len(st.ins) > 4 and st.ins[4] >= 0 else None
    if not torch.is_tensor(w) or not torch.is_tensor(ws) or (st.ins[2] >= 0 and wz is None) or \
            (len(st.ins) > 4 and st.ins[4] >= 0 and not torch.is_tensor(b)):
        return None
    got = _dyn_qgemm(st.call, w, wz) if x.shape[-1] == w.shape[0] else None
    shape = tuple(outs[0].shape)
    if got is None or shape != (*x.shape[:-1], w.shape[1]) or math.prod(shape) == 0:
        return None
    qw, off = got
    ws = ws.float().reshape(-1).contiguous()
    bias = None if b is None else b.float().reshape(-1).contiguous()
    pc.keep += [ws] + ([] if bias is None else [bias])
    x, ldx = _rows(pc, x)
    for t in (qw.packed, qw.colsum, ws):
        pc.keep.append(t)
    y = pc.alloc(shape, contiguous_strides(shape))
    rec = [OP_QGEMM, qw.code, math.prod(shape[:-1]), qw.n, qw.k]
    pc.put(rec, x)
    rec += [ldx, pc.fparam(0.0), 0, pc.fixed(qw.packed), pc.fixed(qw.colsum), pc.fixed(ws),
            ws.numel(), -1 if bias is None else pc.fixed(bias)]
    pc.put(rec, None)
    rec.append(0)
    pc.put(rec, y)
    rec += [qw.n, 0, pc.fparam(0.0, 0.0, 0.0, 0.0, 0.0, 0.0), off]
    pc.emit(rec)
    return [y]


PLANNERS = {I8.Int8MatMul: _int8, I8.Int8MatMulQDQ: _int8,
            I8.QuantizeDequantize: _quantize_dequantize, I8.QLinearMatMulQDQ: _qbmm,
            I8.DynamicConvInteger: _dq_conv, I8.DynamicMatMulInteger: _dyn_matmul}
