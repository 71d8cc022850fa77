"""Planners for data movement and small reductions that streaming audio models write between
their convolutions: reflect and edge ``Pad``, ``Gather`` by constant indices, ``Pow`` by a
constant exponent, ``ReduceMean``/``ReduceMax``. Each becomes copies, an elementwise record or a
pooling record over a view, so the program does not stop for PyTorch there.

Reflect and edge pads are copies from the output into itself along one padded axis at a time,
through views that step backwards (reflect: ``y[pb - 1 - j] = y[pb + 1 + j]``) or not at all
(edge: stride 0); an axis done earlier is copied whole, one still to do only where the input
is, so the corners come out as ONNX's sequential per-axis definition gives them.
"""

from __future__ import annotations

from kiln import native
from kiln.engine import program_ops
from kiln.engine.program import Val
from kiln.engine.program_ops import _const_ints, _const_scalar, _emit_pool, emit_copy, emit_pw
from kiln.ops import math as M
from kiln.ops import reduce as R
from kiln.ops import tensor as T

# Gather indices that are not evenly spaced become one copy each, up to this many
MAX_GATHER_COPIES = 16


# ---- Pad --------------------------------------------------------------------------------------

def _pad(pc, st, ins, outs):
    mode = st.node.attrs.mode or "constant"
    if mode == "constant":
        return program_ops.pad_constant(pc, st, ins, outs)
    x = ins[0]
    if mode not in ("reflect", "edge") or x is None or len(outs) != 1 or len(st.ins) < 2:
        return None
    pads, axes = _const_ints(pc, st, 1), _const_ints(pc, st, 3)
    if not pads or axes is None:
        return None
    rank = len(x.shape)
    axes = [a % rank for a in axes] or list(range(rank))
    if len(pads) != 2 * len(axes) or min(pads) < 0:
        return None
    before, after = [0] * rank, [0] * rank
    for j, a in enumerate(axes):
        before[a], after[a] = pads[j], pads[j + len(axes)]
    shape = tuple(outs[0].shape)
    if shape != tuple(d + b + e for d, b, e in zip(x.shape, before, after)):
        return None
    if mode == "reflect" and any((b or e) and max(b, e) > d - 1
                                 for d, b, e in zip(x.shape, before, after)):
        return None  # a pad wider than the axis reflects more than once: left to torch
    y = pc.alloc(shape)
    start = sum(b * s for b, s in zip(before, y.strides))
    emit_copy(pc, x, Val(x.shape, y.strides, y.buf, y.off + start, y.root))
    done: set[int] = set()
    for a in range(rank):
        if before[a] or after[a]:
            _fill_axis(pc, y, x.shape, before, a, done, mode)
            done.add(a)
    return [y]


def _fill_axis(pc, y: Val, inner: tuple, before: list, a: int, done: set, mode: str) -> None:
    """Axis ``a``'s two pad regions of ``y``, copied from ``y`` itself."""
    size, pb = inner[a], before[a]
    pe = y.shape[a] - size - pb

    def region(lo: int, n: int, step: int = 1) -> Val:
        shape, off = [], y.off
        strides = list(y.strides)
        for d in range(len(y.shape)):
            if d == a:
                shape.append(n)
                off += lo * y.strides[d]
                strides[d] = step * y.strides[d]
            elif d in done:
                shape.append(y.shape[d])
            else:
                shape.append(inner[d])
                off += before[d] * y.strides[d]
        return Val(tuple(shape), tuple(strides), y.buf, off, y.root)

    if pb:
        src = region(2 * pb, pb, -1) if mode == "reflect" else region(pb, pb, 0)
        emit_copy(pc, src, region(0, pb))
    if pe:
        last = pb + size - 1
        src = region(last - 1, pe, -1) if mode == "reflect" else region(last, pe, 0)
        emit_copy(pc, src, region(pb + size, pe))


# ---- Gather -----------------------------------------------------------------------------------

def _gather(pc, st, ins, outs):
    """Gather of a float32 value by constant indices: a view where they are evenly spaced (one
    index: the axis dropped), else one copy per index."""
    x = ins[0]
    if x is None or len(outs) != 1 or len(st.ins) < 2:
        return None
    c = pc.const(st.ins[1])
    if c is None or not hasattr(c, "reshape") or c.dtype.is_floating_point:
        return None
    rank = len(x.shape)
    ax = (st.node.attrs.axis or 0) % rank
    size = x.shape[ax]
    idx = [int(i) for i in c.reshape(-1).tolist()]
    if any(not -size <= i < size for i in idx):
        return None  # (torch's kernel raises the index error)
    idx = [i % size for i in idx]
    if not idx:  # no index (a detector's empty selection folded to a constant): torch's
        return None
    shape = tuple(outs[0].shape)
    if c.dim() == 0:
        keep = tuple(d for d in range(rank) if d != ax)
        return [Val(shape, tuple(x.strides[d] for d in keep), x.buf,
                    x.off + idx[0] * x.strides[ax], x.root)]
    steps = {b - a for a, b in zip(idx, idx[1:])}
    if len(steps) <= 1 and (not steps or steps != {0}):
        step = steps.pop() if steps else 1
        # the indices' dims (any rank: the mask an export builds gathers by a [1, 1, 1, S]
        # arange) step through the axis as the evenly spaced flat indices do
        inner, ist = 1, []
        for n in reversed(tuple(c.shape)):
            ist.append(step * inner * x.strides[ax])
            inner *= n
        strides = x.strides[:ax] + tuple(reversed(ist)) + x.strides[ax + 1:]
        return [Val(shape, strides, x.buf, x.off + idx[0] * x.strides[ax], x.root)]
    if c.dim() > 1 or len(idx) > MAX_GATHER_COPIES:
        return None
    y = pc.alloc(shape)
    part = tuple(1 if d == ax else n for d, n in enumerate(x.shape))
    for j, i in enumerate(idx):
        emit_copy(pc, Val(part, x.strides, x.buf, x.off + i * x.strides[ax], x.root),
                  Val(part, y.strides, y.buf, y.off + j * y.strides[ax], y.root))
    return [y]


# ---- Expand -----------------------------------------------------------------------------------

def _expand(pc, st, ins, outs):
    """Expand: a broadcast view (stride 0 along the dims it repeats), no record. Grouped-query
    attention's key/value heads (Unsqueeze -> Expand -> Reshape) are then one copy, the
    Reshape's; records read stride-0 operands as they read any strides, and a torch record or
    an output gets them copied out."""
    x = ins[0]
    if x is None or len(outs) != 1:
        return None
    shape = tuple(outs[0].shape)
    k = len(shape) - len(x.shape)
    if k < 0 or any(n not in (1, shape[k + d]) for d, n in enumerate(x.shape)):
        return None
    strides = tuple(0 if d < k or x.shape[d - k] != shape[d] else x.strides[d - k]
                    for d in range(len(shape)))
    return [Val(shape, strides, x.buf, x.off, x.root)]


# ---- Pow --------------------------------------------------------------------------------------

def _pow(pc, st, ins, outs):
    """Pow by a constant exponent of 1, 2, 0.5 or -1: a copy, x * x, Sqrt or Reciprocal (exact,
    as torch.pow computes these)."""
    x = ins[0]
    e = _const_scalar(pc, st, 1)
    if x is None or len(outs) != 1 or e not in (1.0, 2.0, 0.5, -1.0) or \
            tuple(outs[0].shape) != tuple(x.shape):
        return None
    shape = tuple(outs[0].shape)
    y = pc.alloc(shape, program_ops._dense_like(shape, x))
    if e == 2.0:
        ok = emit_pw(pc, native.POINTWISE["Mul"], y, x, x)
    else:
        op = {1.0: "Copy", 0.5: "Sqrt", -1.0: "Reciprocal"}[e]
        ok = emit_pw(pc, native.POINTWISE[op], y, x)
    return [y] if ok else None


# ---- ReduceMean, ReduceMax --------------------------------------------------------------------

def _reduce(kind: str):
    def plan(pc, st, ins, outs):
        x = ins[0]
        if x is None or len(outs) != 1 or not x.shape:
            return None
        a = st.node.attrs
        axes = _const_ints(pc, st, 1) if len(st.ins) > 1 else list(a.axes or [])
        if axes is None:
            return None
        rank = len(x.shape)
        if not axes:
            if getattr(a, "noop_with_empty_axes", 0):
                return None
            axes = list(range(rank))
        red = sorted({d % rank for d in axes})
        kept = [d for d in range(rank) if d not in red]
        if any(x.shape[d] == 0 for d in red):
            return None  # an empty window: torch's identities
        outer = _collapse([(x.shape[d], x.strides[d]) for d in kept])
        window = _collapse([(x.shape[d], x.strides[d]) for d in red])
        if outer is None or window is None:
            return None
        shape = tuple(outs[0].shape)
        (n, sn), (c, sc) = outer
        (h, sh), (w, sw) = window
        y = pc.alloc(shape)
        rows = Val((n, c, 1, 1), (c, 1, 0, 0), y.buf, y.off, y.root)
        view = Val((n, c, h, w), (sn, sc, sh, sw), x.buf, x.off, x.root)
        _emit_pool(pc, kind, view, (n, c, 1, 1), (h, w), (1, 1), (1, 1), (0, 0), out=rows)
        return [y]
    return plan


def _collapse(dims: list) -> list | None:
    """(size, stride) dims as exactly two, merged where they step evenly; None where they do
    not merge into two."""
    dims = [(n, s) for n, s in dims if n != 1]
    i = len(dims) - 2
    while i >= 0:
        (n0, s0), (n1, s1) = dims[i], dims[i + 1]
        if s0 == s1 * n1:
            dims[i:i + 2] = [(n0 * n1, s1)]
        i -= 1
    if len(dims) > 2:
        return None
    return [(1, 0)] * (2 - len(dims)) + dims


PLANNERS = {T.Pad: _pad, T.Gather: _gather, M.Pow: _pow, T.Expand: _expand,
            R.ReduceMean: _reduce("avg"), R.ReduceMax: _reduce("max")}
