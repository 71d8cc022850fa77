"""Planners of native program records, one table keyed by op (see :mod:`kiln.engine.program`).

A planner ``(pc, step, ins, outs) -> [Val] | None`` gets the step's inputs as program values
(None where one is not a float32 value the interpreter can read) and the traced ``Meta`` of its
outputs; it emits records through ``pc`` and returns the output values, or returns None having
emitted nothing, and the step runs as a torch record. Views (reshapes of contiguous values,
transposes) emit nothing at all.
"""

from __future__ import annotations

import json

from kiln import native
from kiln.engine.program import (
    Val,
    channels_last_strides,
    contiguous_strides,
    is_channels_last,
    is_contiguous,
    view_strides,
)
from kiln.ir import REGISTRY
from kiln.ops import fused_conv as FC
from kiln.ops import fused_transformer as FT
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import tensor as T

OP_PW, OP_POOL, OP_DW, OP_WINO, OP_GEMM, OP_CONV = 4, 5, 6, 7, 1, 10  # chain.c's kinds
RANK = 6


# ---- elementwise records ----------------------------------------------------------------------

def _bstrides(v: Val, shape: tuple) -> list:
    """``v``'s strides over ``shape`` (ONNX broadcasting: aligned right, size-1 dims read 0)."""
    k = len(shape) - len(v.shape)
    return [0 if d < k or v.shape[d - k] == 1 else v.strides[d - k] for d in range(len(shape))]


def _collapse(shape, strides: list[list]) -> tuple[list, list[list]]:
    """Size-1 dims dropped, the rest ordered by the output's strides (``strides[0]``), largest
    first, and neighbours merged where every operand steps evenly across them. The order puts
    the output's contiguous dim innermost, where the kernel runs whole vectors: a channels-last
    value seen as [N, C, H, W] is walked as [N, H, W, C], not a strided row per channel."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1),
                  key=lambda d: -strides[0][d])
    sh = [shape[d] for d in dims]
    ss = [[s[d] for d in dims] for s in strides]
    d = len(sh) - 2
    while d >= 0:
        if all(s[d] == s[d + 1] * sh[d + 1] for s in ss):
            sh[d:d + 2] = [sh[d] * sh[d + 1]]
            for s in ss:
                s[d:d + 2] = [s[d + 1]]
        d -= 1
    return sh, ss


def _pad(xs: list) -> list:
    return list(xs) + [0] * (RANK - len(xs))


def emit_pw(pc, code: int, y: Val, a: Val, b: Val | None = None, p0=0.0, p1=0.0) -> bool:
    """One elementwise record ``y = op(a[, b])``; False (nothing emitted) past 6 dims."""
    ops = [y.strides, _bstrides(a, y.shape)] + ([_bstrides(b, y.shape)] if b else [])
    shape, ss = _collapse(y.shape, [list(s) for s in ops])
    if len(shape) > RANK:
        return False
    rec = [OP_PW, code, len(shape), *_pad(shape)]
    pc.put(rec, y)
    rec += _pad(ss[0])
    pc.put(rec, a)
    rec += _pad(ss[1])
    pc.put(rec, b)
    rec += _pad(ss[2] if b else [])
    rec.append(pc.fparam(p0, p1))
    pc.emit(rec)
    return True


def emit_copy(pc, src: Val, dst: Val) -> bool:
    return emit_pw(pc, native.POINTWISE["Copy"], dst, src)


def _dense_like(shape: tuple, *vs: Val | None) -> tuple:
    """Strides for a new value of ``shape``: channels-last when an input of that shape is."""
    if len(shape) in (3, 4) and any(v is not None and v.shape == shape and not is_contiguous(v)
                                    and _channels_last(v) for v in vs):
        n, c, *sp = shape
        return channels_last_strides(shape) if sp[1:] else (sp[0] * c, 1, c)
    return contiguous_strides(shape)


def _channels_last(v: Val) -> bool:
    """``v`` (3-D or 4-D) stored with the channels innermost: [N, H, W, C] or [N, L, C]."""
    if len(v.shape) == 4:
        return is_channels_last(v)
    n, c, length = v.shape
    return all(d == 1 or s == e for d, s, e in zip(v.shape, v.strides, (length * c, 1, c)))


def _float_ins(ins, n: int) -> bool:
    return len(ins) >= n and all(v is not None for v in ins[:n])


def _const_scalar(pc, st, i: int):
    """Input ``i`` of the step as a Python float when it is a constant of one element."""
    if len(st.ins) <= i or st.ins[i] < 0:
        return None
    c = pc.consts.get(st.ins[i])
    if c is None or not hasattr(c, "numel") or c.numel() != 1:
        return False
    return float(c.reshape(-1)[0])


def _elementwise(name: str):
    code = native.POINTWISE[name]
    binary = name in native.BINARY

    def plan(pc, st, ins, outs):
        if len(outs) != 1 or not _float_ins(ins, 2 if binary else 1) or (
                binary and len(ins) != 2):
            return None
        if binary and getattr(st.node.attrs, "broadcast", None):
            return None  # opset < 7 broadcasting aligns at ``axis``, not numpy's way: torch's
        p0, p1 = _params(name, pc, st)
        if p0 is None:
            return None
        shape = outs[0].shape
        y = pc.alloc(shape, _dense_like(shape, *ins))
        if not emit_pw(pc, code, y, ins[0], ins[1] if binary else None, p0, p1):
            return None
        return [y]
    return plan


def _params(name: str, pc, st) -> tuple:
    """(p0, p1) of an elementwise op, (None, None) where they are not constant."""
    a = st.node.attrs
    if name == "LeakyRelu":
        return (0.01 if a.alpha is None else a.alpha), 0.0
    if name == "HardSigmoid":
        return (0.2 if a.alpha is None else a.alpha), (0.5 if a.beta is None else a.beta)
    if name == "Clip":
        lo, hi = _const_scalar(pc, st, 1), _const_scalar(pc, st, 2)
        if lo is False or hi is False:
            return None, None
        if len(st.ins) <= 1 and getattr(a, "min", None) is not None:
            lo = a.min
        if len(st.ins) <= 2 and getattr(a, "max", None) is not None:
            hi = a.max
        return (float("-inf") if lo is None else lo), (float("inf") if hi is None else hi)
    return 0.0, 0.0


_OP_NAMES = {M.Add: "Add", M.Sub: "Sub", M.Mul: "Mul", M.Div: "Div", M.Max: "Max", M.Min: "Min",
             M.PRelu: "PRelu", M.Relu: "Relu", M.Sigmoid: "Sigmoid", M.Tanh: "Tanh",
             M.Exp: "Exp", M.Neg: "Neg", M.Abs: "Abs", M.Sqrt: "Sqrt",
             M.Reciprocal: "Reciprocal", M.LeakyRelu: "LeakyRelu",
             M.HardSigmoid: "HardSigmoid", M.HardSwish: "HardSwish", M.Clip: "Clip"}


_GELU = {"none": _elementwise("Gelu"), "tanh": _elementwise("GeluTanh")}


def _gelu(pc, st, ins, outs):
    """Gelu (opset 20, or a matched one): the erf form or, ``approximate='tanh'``, the tanh
    one, as the activation record GEMM epilogues use."""
    plan = _GELU.get(getattr(st.node.attrs, "approximate", None) or "none")
    return None if plan is None else plan(pc, st, ins, outs)


def _fused_pointwise(pc, st, ins, outs):
    """FusedPointwise's program as one record per step, its intermediates in the arena."""
    steps = json.loads(st.node.attrs.program)
    if len(outs) != 1 or any(v is None for v in ins):
        return None
    names = [_OP_NAMES.get(REGISTRY.get("", op)) for op, _ in steps]
    if any(n is None or n == "Clip" for n in names):
        return None
    vals: list[Val] = []
    for i, ((_, refs), name) in enumerate(zip(steps, names)):
        args = [vals[int(r[1:])] if r[0] == "s" else ins[int(r[1:])] for r in refs]
        if len(args) != (2 if name in native.BINARY else 1):
            return None
        shape = outs[0].shape if i == len(steps) - 1 else _broadcast(*args)
        y = pc.alloc(shape, _dense_like(shape, *args))
        if not emit_pw(pc, native.POINTWISE[name], y, *args):
            return None  # (records already emitted write arena values nothing reads)
        vals.append(y)
    return [vals[-1]]


def _broadcast(*vs: Val) -> tuple:
    rank = max(len(v.shape) for v in vs)
    out = []
    for d in range(rank):
        sizes = {v.shape[d - rank + len(v.shape)] for v in vs if d - rank + len(v.shape) >= 0}
        out.append(max(sizes))
    return tuple(out)


# ---- views and copies -------------------------------------------------------------------------

def _reshape(pc, st, ins, outs):
    """Reshape, Flatten, Squeeze, Unsqueeze: a view, no record, wherever the new shape can be
    read off the input's strides (:func:`view_strides`: a transposed key split or merged along
    dims that stay contiguous with each other, as the dynamo exporter's Reshape -> Transpose
    -> Reshape writes it), else a contiguous copy seen in the new shape. Planners that need
    contiguous rows copy where a view's rows do not collapse."""
    x = ins[0]
    if x is None or len(outs) != 1:
        return None
    shape = outs[0].shape
    strides = view_strides(x.shape, x.strides, shape)
    if strides is None:
        y = pc.alloc(x.shape)
        if not emit_copy(pc, x, y):
            return None
        x, strides = y, contiguous_strides(shape)
    return [Val(shape, strides, x.buf, x.off, x.root)]


def _identity(pc, st, ins, outs):
    return None if ins[0] is None or len(outs) != 1 else [ins[0]]


def _transpose(pc, st, ins, outs):
    x = ins[0]
    if x is None or len(outs) != 1:
        return None
    perm = st.node.attrs.perm or list(reversed(range(len(x.shape))))
    return [Val(tuple(x.shape[p] for p in perm), tuple(x.strides[p] for p in perm), x.buf,
                x.off, x.root)]


def _const_ints(pc, st, i: int):
    """Input ``i`` of the step as a list of ints when it is a constant, [] where it is absent,
    None where it is computed."""
    if len(st.ins) <= i or st.ins[i] < 0:
        return []
    c = pc.const(st.ins[i])
    return None if c is None or not hasattr(c, "reshape") else [
        int(v) for v in c.reshape(-1).tolist()]


def _slice(pc, st, ins, outs):
    """Slice with constant bounds and positive steps: a strided view, no record (a channel
    split is an offset into the same memory)."""
    x = ins[0]
    if x is None or len(outs) != 1:
        return None
    if len(st.ins) > 1:
        starts, ends, axes, steps = (_const_ints(pc, st, i) for i in range(1, 5))
        if starts is None or ends is None or axes is None or steps is None:
            return None
    else:  # opset < 10: attributes
        a = st.node.attrs
        starts, ends, axes, steps = list(a.starts), list(a.ends), list(a.axes or []), []
    rank = len(x.shape)
    axes = axes or list(range(len(starts)))
    steps = steps or [1] * len(starts)
    if not (len(starts) == len(ends) == len(axes) == len(steps)) or min(steps, default=1) < 1:
        return None
    shape, strides, off = list(x.shape), list(x.strides), x.off
    for a, b, e, p in zip(axes, starts, ends, steps):
        a %= rank
        lo, hi, step = slice(b, e, p).indices(x.shape[a])
        shape[a] = len(range(lo, hi, step))
        off += lo * x.strides[a] if shape[a] else 0
        strides[a] *= step
    if tuple(shape) != tuple(outs[0].shape):
        return None
    return [Val(tuple(shape), tuple(strides), x.buf, off, x.root)]


def _gather_one(pc, st, ins, outs):
    """Gather of one constant index (a scalar: the dim goes) from a program value: a view,
    no record (BERT's pooler reading the first token, a head picked by index)."""
    x, idx = ins[0], _const_ints(pc, st, 1)
    c = pc.const(st.ins[1]) if len(st.ins) > 1 else None
    if x is None or len(outs) != 1 or not idx or len(idx) != 1 or c.dim() != 0:
        return None
    ax = (st.node.attrs.axis or 0) % len(x.shape)
    i = idx[0] + x.shape[ax] if idx[0] < 0 else idx[0]
    if not 0 <= i < x.shape[ax]:
        return None  # out of range: the torch record raises ONNX's error
    shape = x.shape[:ax] + x.shape[ax + 1:]
    if shape != tuple(outs[0].shape):
        return None
    return [Val(shape, x.strides[:ax] + x.strides[ax + 1:], x.buf, x.off + i * x.strides[ax],
                x.root)]


def _split(pc, st, ins, outs):
    """Split whose sizes are constant (an input, the attribute, or even parts): its outputs
    are views of consecutive ranges along the axis, no record; the sizes are the traced
    outputs' (the plan is per input shape)."""
    x = ins[0]
    if x is None or not outs or any(m is None for m in outs) or (
            len(st.ins) > 1 and _const_ints(pc, st, 1) is None):
        return None
    rank = len(x.shape)
    axis = (st.node.attrs.axis or 0) % rank
    start, made = 0, []
    for m in outs:
        if len(m.shape) != rank or any(a != b for d, (a, b) in enumerate(zip(m.shape, x.shape))
                                       if d != axis):
            return None
        made.append(Val(tuple(m.shape), x.strides, x.buf, x.off + start * x.strides[axis],
                        x.root))
        start += m.shape[axis]
    return made if start == x.shape[axis] else None


def _concat(pc, st, ins, outs):
    if len(outs) != 1 or not ins or any(v is None for v in ins):
        return None
    shape = outs[0].shape
    axis = st.node.attrs.axis % len(shape)
    y = pc.alloc(shape, _concat_strides(shape, ins[0]))
    start = 0
    for v in ins:
        part = Val(v.shape, y.strides, y.buf, y.off + start * y.strides[axis], y.root)
        if v.shape[axis] and not emit_copy(pc, v, part):
            return None
        start += v.shape[axis]
    return [y]


def _concat_strides(shape, first: Val) -> tuple:
    if len(shape) == 4 and is_channels_last(first) and not is_contiguous(first):
        return channels_last_strides(shape)
    return contiguous_strides(shape)


def pad_constant(pc, st, ins, outs):
    """Constant Pad with non-negative constant pads: the fill, then the input copied in."""
    x = ins[0]
    if x is None or len(outs) != 1 or (st.node.attrs.mode or "constant") != "constant":
        return None
    consts = [pc.consts.get(i) if i >= 0 else None for i in st.ins[1:]]
    if len(st.ins) < 2 or consts[0] is None or any(
            st.ins[k + 1] >= 0 and c is None for k, c in enumerate(consts)):
        return None
    pads = [int(p) for p in consts[0].reshape(-1).tolist()]
    rank = len(x.shape)
    axes = list(range(rank)) if len(consts) < 3 or consts[2] is None else [
        int(a) % rank for a in consts[2].reshape(-1).tolist()]
    if min(pads, default=0) < 0 or len(pads) != 2 * len(axes):
        return None
    value = 0.0
    if len(consts) > 1 and consts[1] is not None and consts[1].numel():
        value = float(consts[1].reshape(-1)[0])
    before = [0] * rank
    for j, a in enumerate(axes):
        before[a] = pads[j]
    shape = outs[0].shape
    y = pc.alloc(shape, _dense_like(shape, x))
    fill = scalar(pc, value)
    if not emit_copy(pc, fill, y):
        return None
    start = sum(b * s for b, s in zip(before, y.strides))
    if not emit_copy(pc, x, Val(x.shape, y.strides, y.buf, y.off + start, y.root)):
        return None
    return [y]


def scalar(pc, value: float) -> Val:
    import torch

    t = torch.tensor(value, dtype=torch.float32)
    return Val((), (), pc.fixed(t), 0, -1)


# ---- pooling ----------------------------------------------------------------------------------

def _pool(kind: str):
    def plan(pc, st, ins, outs):
        x = ins[0]
        if x is None or len(x.shape) != 4 or len(outs) != 1:
            return None
        a = st.node.attrs
        k, s, d, p = N.spatial_attrs(a, 2)
        ceil = bool(getattr(a, "ceil_mode", 0))
        _, pb, _ = N.window_geometry(list(x.shape[2:]), k, s, d, p, a.auto_pad, ceil)
        mode = kind
        if kind == "avg":
            mode = "avg_pad" if a.count_include_pad else "avg"
            if mode == "avg_pad" and ceil:
                return None  # a clipped last window's divisor: left to torch
        return _emit_pool(pc, mode, x, outs[0].shape, k, s, d, pb)
    return plan


def _global_pool(kind: str):
    def plan(pc, st, ins, outs):
        x = ins[0]
        if x is None or len(x.shape) != 4 or len(outs) != 1:
            return None
        h, w = x.shape[2:]
        return _emit_pool(pc, kind, x, outs[0].shape, (h, w), (1, 1), (1, 1), (0, 0))
    return plan


def _emit_pool(pc, kind, x: Val, shape, k, s, d, pb, out: Val | None = None):
    """A pooling record over the [N, C, H, W] value ``x``, into ``out`` or a new value."""
    y = out or pc.alloc(shape, _dense_like(shape, x) if len(shape) != 4 or not is_channels_last(x)
                        else channels_last_strides(shape))
    rec = [OP_POOL, native.POOLS[kind], *x.shape, *shape[2:], *k, *s, *d, *pb]
    pc.put(rec, x)
    rec += list(x.strides)
    pc.put(rec, y)
    rec += list(y.strides)
    pc.emit(rec)
    return [y]


# ---- convolutions by kiln's kernels -----------------------------------------------------------

def fused_conv(pc, st, ins, outs):
    """A FusedConv whose tactic at this shape is one of kiln's kernels (its function, with the
    packed weight, is in the node's cache since the traced run); oneDNN's run as torch
    records."""
    x, r = ins[0], (ins[3] if len(ins) > 3 else None)
    if x is None or len(x.shape) != 4 or len(outs) != 1:
        return None
    if len(st.ins) > 3 and st.ins[3] >= 0 and r is None:
        return None
    key = (x.shape, None if r is None else r.shape)
    fn = (st.call.cache.get("conv_plans") or {}).get(key)
    params = getattr(fn, "native", None)
    if params is None:
        return None
    shape = outs[0].shape
    xs = _nhwc(pc, x)
    rs = None if r is None else _nhwc(pc, r)
    y = pc.alloc(shape, channels_last_strides(shape))
    kind = params["kind"]
    if kind == "gemm":
        sh, sw = params["stride"]
        if (sh, sw) != (1, 1):  # the pixels a strided 1x1 conv reads, gathered
            xs = Val((n := xs.shape[0], xs.shape[1], *shape[2:]), (xs.strides[0], xs.strides[1],
                     xs.strides[2] * sh, xs.strides[3] * sw), xs.buf, xs.off, xs.root)
            g = pc.alloc(xs.shape, channels_last_strides(xs.shape))
            emit_copy(pc, xs, g)
            xs = g
        return _emit_gemm_conv(pc, params, xs, rs, y)
    rec = [{"depthwise": OP_DW, "direct": OP_CONV}.get(kind, OP_WINO)]
    n, c, h, w = x.shape
    ho, wo = shape[2:]
    pt, pl = params["pad"]
    if kind == "depthwise":
        rec += [n, h, w, c, ho, wo, *params["kernel"], *params["stride"], *params["dilation"],
                pt, pl]
    elif kind == "direct":
        rec += [n, h, w, c, shape[1], ho, wo, *params["kernel"], *params["stride"],
                *params["dilation"], pt, pl]
    else:
        rec += [n, h, w, c, shape[1], ho, wo, pt, pl]
    pc.put(rec, xs)
    rec += [pc.fixed(params["weight"]), _bias(pc, params)]
    pc.put(rec, rs)
    pc.put(rec, y)
    rec += [params["act"], pc.fparam(params["lo"], params["hi"])]
    pc.emit(rec)
    return [y]


_SE_ACTS = ("", "Relu", "Sigmoid", "Tanh", "Silu", "Gelu", "GeluTanh", "HardSwish")


def _squeeze_excite(pc, st, ins, outs):
    """SqueezeExcite as records: the global mean, the two 1x1 convs as kiln GEMMs on the [N, C]
    vector (the activation, and a Sigmoid gate, in their epilogues; a HardSigmoid gate as its
    own record), and the broadcast product."""
    x = ins[0]
    a = st.node.attrs
    if x is None or len(x.shape) != 4 or len(outs) != 1 or not native.available \
            or a.activation not in _SE_ACTS or a.gate not in ("Sigmoid", "HardSigmoid"):
        return None
    import torch

    ws = [pc.consts.get(i) if 0 <= i else None for i in (list(st.ins[1:]) + [-1] * 4)[:4]]
    w1, b1, w2, b2 = ws
    if w1 is None or w2 is None or any(
            t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in ws):
        return None
    if (len(st.ins) > 2 and st.ins[2] >= 0 and b1 is None) or (
            len(st.ins) > 4 and st.ins[4] >= 0 and b2 is None):
        return None  # a computed bias
    n, c, h, w = x.shape
    cr = w1.shape[0]
    if w1.numel() != cr * c or tuple(w2.shape[:2]) != (c, cr) or w2.numel() != c * cr:
        return None
    s = _emit_pool(pc, "avg", x, (n, c, 1, 1), (h, w), (1, 1), (1, 1), (0, 0))[0]
    s = Val((n, c), (c, 1), s.buf, s.off, s.root)  # [N, C, 1, 1] in either layout
    hid = pc.alloc((n, cr))
    _emit_small_gemm(pc, s, w1.reshape(cr, c), b1, hid, a.activation)
    g = pc.alloc((n, c))
    sigmoid = a.gate == "Sigmoid"
    _emit_small_gemm(pc, hid, w2.reshape(c, cr), b2, g, "Sigmoid" if sigmoid else "")
    if not sigmoid:
        emit_pw(pc, native.POINTWISE["HardSigmoid"], g, g, None, a.alpha, a.beta)
    shape = outs[0].shape
    y = pc.alloc(shape, _dense_like(shape, x))
    gv = Val((n, c, 1, 1), (c, 1, 1, 1), g.buf, g.off, g.root)
    if not emit_pw(pc, native.POINTWISE["Mul"], y, x, gv):
        return None
    return [y]


def _emit_small_gemm(pc, x: Val, w, b, y: Val, act: str) -> None:
    """``y = act(x @ w^T + b)`` for a contiguous [M, K] ``x`` and a constant [N, K] ``w``."""
    m, k = x.shape[0], w.shape[1]
    nout = w.shape[0]
    pw = native.PackedWeight(w.t())
    pc.keep.append(pw)
    lo, hi = native._epilogue_params(act, None, None)
    rec = [OP_GEMM, m, nout, k]
    pc.put(rec, x)
    rec += [k, pc.fixed(pw.data), -1 if b is None else pc.fixed(b.contiguous())]
    pc.put(rec, None)
    rec.append(nout)
    pc.put(rec, y)
    rec += [nout, native.ACTIVATIONS[act], pc.fparam(lo, hi)]
    pc.emit(rec)


def _emit_gemm_conv(pc, params, xs: Val, rs: Val | None, y: Val):
    n, c, h, w = xs.shape
    k_out = y.shape[1]
    rows = n * h * w
    rec = [OP_GEMM, rows, k_out, c]
    pc.put(rec, xs)
    rec += [c, pc.fixed(params["weight"]), _bias(pc, params)]
    pc.put(rec, rs)
    rec.append(k_out)
    pc.put(rec, y)
    rec += [k_out, params["act"], pc.fparam(params["lo"], params["hi"])]
    pc.emit(rec)
    return [y]


def _bias(pc, params) -> int:
    b = params.get("bias")
    return -1 if b is None else pc.fixed(b)


def _nhwc(pc, v: Val) -> Val:
    """``v`` (a 4-D value) channels-last, copied into that layout where it is not."""
    if is_channels_last(v):
        return v
    y = pc.alloc(v.shape, channels_last_strides(v.shape))
    emit_copy(pc, v, y)
    return y


PLANNERS = {op: _elementwise(name) for op, name in _OP_NAMES.items()}
PLANNERS.update({
    FT.FusedPointwise: _fused_pointwise, M.Gelu: _gelu,
    T.Reshape: _reshape, T.Flatten: _reshape, T.Squeeze: _reshape, T.Unsqueeze: _reshape,
    T.Identity: _identity, T.Transpose: _transpose, T.Concat: _concat, T.Pad: pad_constant,
    N.MaxPool: _pool("max"), N.AveragePool: _pool("avg"),
    N.GlobalAveragePool: _global_pool("avg"), N.GlobalMaxPool: _global_pool("max"),
    FC.FusedConv: fused_conv, FC.SqueezeExcite: _squeeze_excite, T.Slice: _slice,
    T.Split: _split, T.Gather: _gather_one,
})
