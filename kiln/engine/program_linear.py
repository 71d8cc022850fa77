"""A lone ``FusedGemm`` or ``FusedMatMul`` by a constant weight whose tactic at this shape is
kiln's GEMM, as one GEMM record (bias, residual and activation in its epilogue) on the weight
the tactic packed: the classifier head after a recurrent layer, which a native chain (two or
more such steps in a row) does not take. Another tactic (MKL, oneDNN) stays a torch record, so
that a planned run computes what the traced one did. Rows of the input (and residual) must
collapse to one stride over a contiguous last dim; others are copied contiguous first.
"""

from __future__ import annotations

import math

import torch

from kiln import native
from kiln.engine.program import Val, contiguous_strides
from kiln.engine.program_ops import OP_GEMM, emit_copy
from kiln.ops import fused_conv as FC


def _rows(pc, v: Val) -> tuple[Val, int]:
    """(``v`` or a contiguous copy of it, its row stride) for ``v`` read as [rows, last dim]."""
    shape, strides = v.shape, v.strides
    k = shape[-1]
    ok = k == 1 or strides[-1] == 1
    lead = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]
    for (_, s0), (n1, s1) in zip(lead, lead[1:]):
        ok = ok and s0 == s1 * n1
    if ok:
        return v, (lead[-1][1] if lead else k)
    c = pc.alloc(shape)
    emit_copy(pc, v, c)
    return c, k


def _weight(pc, st):
    """(the [K, N] float32 weight, the bias or None), or None where they are not constants."""
    a = st.node.attrs
    w = pc.consts.get(st.ins[1]) if len(st.ins) > 1 else None
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.float32:
        return None
    if st.node.op is FC.FusedGemm:
        if a.transA:
            return None
        w = w.t() if a.transB else w
    b = None
    if len(st.ins) > 2 and st.ins[2] >= 0:
        b = pc.consts.get(st.ins[2])
        if not isinstance(b, torch.Tensor) or b.dtype != torch.float32 or \
                tuple(b.shape) != (w.shape[1],):
            return None
    return w, b


def _linear(pc, st, ins, outs):
    x = ins[0]
    got = _weight(pc, st) if x is not None and len(outs) == 1 and native.available else None
    a = st.node.attrs
    if got is None or a.activation not in native.ACTIVATIONS or len(x.shape) < 2:
        return None
    w, b = got
    k, n = w.shape
    shape = tuple(outs[0].shape)
    if x.shape[-1] != k or shape != (*x.shape[:-1], n) or math.prod(shape) == 0:
        return None
    r = ins[3] if len(ins) > 3 else None
    if len(st.ins) > 3 and st.ins[3] >= 0 and (r is None or tuple(r.shape) != shape):
        return None  # a constant or broadcast residual: torch's
    key = (tuple(x.shape), None if r is None else tuple(r.shape))
    fn = (st.call.cache.get("lin_plans") or {}).get(key)
    packed = getattr(fn, "packed", None)
    if getattr(fn, "tactic", None) != "kiln" or packed is None:
        return None
    x, lda = _rows(pc, x)
    ldr = 0
    if r is not None:
        r, ldr = _rows(pc, r)
    pc.keep.append(packed)
    y = pc.alloc(shape, contiguous_strides(shape))
    lo, hi = native._epilogue_params(a.activation, a.alpha, a.beta)
    rec = [OP_GEMM, math.prod(shape[:-1]), n, k]
    pc.put(rec, x)
    rec += [lda, pc.fixed(packed.data), -1 if b is None else pc.fixed(b.contiguous())]
    pc.put(rec, r)
    rec.append(ldr)
    pc.put(rec, y)
    rec += [n, native.ACTIVATIONS[a.activation], pc.fparam(lo, hi)]
    pc.emit(rec)
    return [y]


PLANNERS = {FC.FusedGemm: _linear, FC.FusedMatMul: _linear}
