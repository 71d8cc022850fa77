"""1-D convolutions as native program records: the input laid out channels-last ([N, L, C]),
then one kiln GEMM per group (and per batch item where the rows do not line up), the bias,
residual and activation in its epilogue.

    x [N, C, L] ──copy (pads filled with 0)──▶ xp [N, Lp, C] ──view──▶ A [N * Lo, K * C]
                                                                        │  A @ pack(W^T) + b + R
                                            y [N, Co, Lo] (stored [N, Lo, Co]) ◀── act ──┘

Row ``l`` of A is ``xp[l * stride : l * stride + (K - 1) * dilation + 1 : dilation, :]``, so
with dilation 1 it is a view that steps ``stride * C`` floats per row (rows overlap where the
kernel is wider than the stride: the STFT-like conv of silero-vad reads its 256 taps at
stride 128 without copying anything); a dilated kernel's rows are gathered by one copy first.
A grouped conv's taps are gathered [group][tap][channel] and each group is a GEMM over its
block of columns. The weight [Co, C / G, K] is reordered to [K, C / G] rows per group and packed
once per plan.
"""

from __future__ import annotations

import torch

from kiln import native
from kiln.engine import program_ops
from kiln.engine.program import Val
from kiln.engine.program_ops import OP_GEMM, emit_copy, scalar
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N

# a grouped conv of more groups than this runs as a torch record (one GEMM record per group
# would be a long program of tiny products: depthwise 1-D convs)
MAX_GROUPS = 16


def _nlc(shape) -> tuple:
    n, c, length = shape
    return (length * c, 1, c)


def _is_nlc(v: Val) -> bool:
    return all(d == 1 or s == e for d, s, e in zip(v.shape, v.strides, _nlc(v.shape)))


def _const_f32(pc, st, i: int):
    """Input ``i`` as a float32 CPU constant; None where it is absent, False where computed."""
    if len(st.ins) <= i or st.ins[i] < 0:
        return None
    c = pc.consts.get(st.ins[i])
    if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or c.device.type != "cpu":
        return False
    return c


def _conv1d(pc, st, ins, outs):
    x = ins[0]
    fused = st.node.op is FC.FusedConv
    if x is None or len(x.shape) != 3 or len(outs) != 1 or len(outs[0].shape) != 3 \
            or not native.available:
        return None
    w, b = _const_f32(pc, st, 1), _const_f32(pc, st, 2)
    if w is None or w is False or w.dim() != 3 or b is False:
        return None
    a = st.node.attrs
    r = ins[3] if fused and len(ins) > 3 else None
    if fused and len(st.ins) > 3 and st.ins[3] >= 0 and (r is None or r.shape != outs[0].shape):
        return None
    act = a.activation if fused else ""
    if act not in native.ACTIVATIONS:
        return None
    n, c, length = x.shape
    groups = a.group or 1
    co, cg, k = w.shape
    k_, s, d, p = N.spatial_attrs(a, 1, [k])
    lo_, pb, pe = N.window_geometry([length], k_, s, d, p, a.auto_pad)
    lo = outs[0].shape[2]
    if groups > MAX_GROUPS or cg * groups != c or co % groups or min(pb[0], pe[0]) < 0 \
            or lo_[0] != lo or lo < 1 or tuple(outs[0].shape[:2]) != (n, co):
        return None
    xp = _padded_nlc(pc, x, pb[0], pe[0])
    s, d = s[0], d[0]
    rows = _rows(pc, xp, n, lo, k, s, d, groups)
    y = pc.alloc((n, co, lo), _nlc((n, co, lo)))
    if r is not None and not _is_nlc(r):
        rr = pc.alloc(r.shape, _nlc(r.shape))
        emit_copy(pc, r, rr)
        r = rr
    og = co // groups
    lohi = native._epilogue_params(act, a.alpha, a.beta) if fused else (0.0, 0.0)
    fp = pc.fparam(*lohi)
    for gi in range(groups):
        wg = w[gi * og:(gi + 1) * og].permute(2, 1, 0).reshape(k * cg, og)  # [(k, c), o]
        pw = native.PackedWeight(wg.contiguous())
        pc.keep.append(pw)
        bias = -1 if b is None else pc.fixed(b[gi * og:(gi + 1) * og].contiguous())
        for a_val, m, row0 in rows:
            rec = [OP_GEMM, m, og, k * cg]
            pc.put(rec, a_val._replace(off=a_val.off + gi * k * cg))
            rec += [a_val.strides[0], pc.fixed(pw.data), bias]
            pc.put(rec, None if r is None else _at(r, row0, gi * og))
            rec.append(co)
            pc.put(rec, _at(y, row0, gi * og))
            rec += [co, native.ACTIVATIONS[act], fp]
            pc.emit(rec)
    return [y]


def _at(v: Val, row: int, col: int) -> Val:
    """``v`` (an [N, C, L] value stored [N, L, C]) from flat row ``row`` and channel ``col``."""
    return v._replace(off=v.off + row * v.strides[2] + col)


def _padded_nlc(pc, x: Val, pb: int, pe: int) -> Val:
    """``x`` [N, C, L] as an [N, C, Lp] value stored [N, Lp, C], the pads zero: ``x`` itself
    where it is stored that way unpadded, else a copy."""
    n, c, length = x.shape
    if not pb and not pe and _is_nlc(x):
        return x
    shape = (n, c, length + pb + pe)
    xp = pc.alloc(shape, _nlc(shape))
    zero = scalar(pc, 0.0)
    for start, size in ((0, pb), (pb + length, pe)):
        if size:
            emit_copy(pc, zero, Val((n, c, size), xp.strides, xp.buf,
                                    xp.off + start * c, xp.root))
    emit_copy(pc, x, Val(x.shape, xp.strides, xp.buf, xp.off + pb * c, xp.root))
    return xp


def _rows(pc, xp: Val, n: int, lo: int, k: int, s: int, d: int, groups: int) -> list:
    """The GEMM's A operands: (value whose ``strides[0]`` is the row stride and whose row holds
    the K * C taps contiguously, group by group, row count, first output row), one per batch
    item unless the items' rows line up. A dilated kernel's taps, and a grouped conv's (whose
    rows go [group][tap][channel]), are gathered into rows by one copy first."""
    c, lp = xp.shape[1], xp.shape[2]
    if groups > 1 or (d != 1 and k > 1):
        cg = c // groups
        col = pc.alloc((n, lo, groups, k, cg))
        src = Val(col.shape, (lp * c, s * c, cg, d * c, 1), xp.buf, xp.off, xp.root)
        emit_copy(pc, src, col)
        return [(Val((n * lo, k * c), (k * c, 1), col.buf, col.off, col.root), n * lo, 0)]
    if n == 1 or lp == lo * s:
        return [(Val((n * lo, k * c), (s * c, 1), xp.buf, xp.off, xp.root), n * lo, 0)]
    return [(Val((lo, k * c), (s * c, 1), xp.buf, xp.off + i * lp * c, xp.root), lo, i * lo)
            for i in range(n)]


def _fused_conv(pc, st, ins, outs):
    x = ins[0]
    if x is not None and len(x.shape) == 3:
        return _conv1d(pc, st, ins, outs)
    return program_ops.fused_conv(pc, st, ins, outs)


PLANNERS = {N.Conv: _conv1d, FC.FusedConv: _fused_conv}
