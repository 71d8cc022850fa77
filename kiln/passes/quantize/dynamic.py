"""Dynamic quantization as onnxruntime's ``quantize_dynamic`` writes it, back to one layer::

    x ──DynamicQuantizeLinear──▶ xq, xs, xz
    MatMulInteger(xq, Wq, xz, wz) ──Cast(float)──Mul(·, Mul(xs, ws))──▶ y
                   ==>  y = MatMul(x, (Wq - wz) * ws)      and x marked "dynamic"

The float MatMul then fuses like any other (bias, activation, the merged QKV projection), and
the INT8 rewrite turns it into an Int8MatMul whose activation is quantized on every call from
its own range (``x_scale = 0``), as DynamicQuantizeLinear does. Fires only for a constant int8
or uint8 2-D weight, scalar-or-per-column ``ws`` and ``wz``, and a chain of single users.

Which integers the INT8 layer computes matters, as a code that rounds the other way moves every
later dynamic range: onnxruntime multiplies u8 x s8 (int8 weights) with int16 pair sums that
saturate on AVX2, which kiln's u8s8 kernels reproduce, but u8 x u8 (uint8 weights) exactly. A
uint8 weight folds only when its codes minus zero point fit kiln's 7-bit grid (nothing can
saturate then); otherwise the MatMulInteger stays and runs exact integer arithmetic (a
ddddocr classifier's codes span -119..136: folded, they were rounded onto 7 bits and saturated).
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, Graph, Node, TensorType
from kiln.ir.rewrite import single_user
from kiln.ops import int8 as I8
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import quant as Q
from kiln.passes.quantize.int8 import W_LEVELS

DYNAMIC = (0.0, -1)  # the scale entry of a dynamically quantized activation


def _const(v):
    return None if v is None else v.const


def _match(graph: Graph, mm: Node, users):
    """(x, W float, output value, nodes to drop) or None."""
    if len(mm.inputs) < 2:
        return None
    dql = mm.inputs[0].producer
    wq = _const(mm.inputs[1])
    if dql is None or dql.op is not Q.DynamicQuantizeLinear or wq is None or wq.ndim != 2:
        return None
    if len(mm.inputs) < 3 or mm.inputs[2] is not dql.outputs[2]:
        return None
    wz = _const(mm.inputs[3]) if len(mm.inputs) > 3 and mm.inputs[3] is not None else 0
    cast = single_user(graph, mm.outputs[0], users)
    if cast is None or cast.op is not Q.Cast or Q.cast_target(cast.attrs.to) != DType.float32:
        return None
    mul = single_user(graph, cast.outputs[0], users)
    if mul is None or mul.op is not M.Mul:
        return None
    other = mul.inputs[1] if mul.inputs[0] is cast.outputs[0] else mul.inputs[0]
    smul = other.producer
    if smul is None or smul.op is not M.Mul or dql.outputs[1] not in smul.inputs:
        return None
    ws = _const(smul.inputs[1] if smul.inputs[0] is dql.outputs[1] else smul.inputs[0])
    if ws is None or ws.size not in (1, wq.shape[1]) or np.size(wz) not in (1, wq.shape[1]):
        return None
    if not exact_as_int8(wq, wz):
        return None
    w = (wq.astype(np.float32) - np.asarray(wz, np.float32).reshape(-1)) * \
        ws.astype(np.float32).reshape(-1)
    return dql.inputs[0], w.astype(np.float32), mul.outputs[0], [mm, cast, mul]


def exact_as_int8(wq: np.ndarray, wz) -> bool:
    """Whether kiln's u8s8 INT8 layer computes the integers onnxruntime does for these
    weight codes: int8 ones (the same saturating pair sums), or uint8 ones whose codes minus
    zero point lie within the 7-bit grid (exact in both)."""
    if wq.dtype == np.int8:
        return not np.any(np.asarray(wz) != 0)
    codes = wq.astype(np.int32) - np.asarray(wz, np.int32).reshape(-1)
    return wq.dtype == np.uint8 and int(np.abs(codes).max(initial=0)) <= W_LEVELS


def fold_dynamic_quant(graph: Graph, log=lambda m: None) -> dict[str, tuple[float, int]]:
    """Rewrite each matched pattern (see the module docstring) in place; returns the
    activations quantized dynamically: name -> :data:`DYNAMIC`."""
    users, found, dead = graph.users(), {}, set()
    for mm in [n for n in graph.nodes if n.op is Q.MatMulInteger]:
        m = _match(graph, mm, users)
        if m is None:
            continue
        x, w, out, drop = m
        wv = graph.add_weight(graph.fresh_name(f"{mm.inputs[1].name}_float"), w,
                              TensorType(DType.float32, w.shape))
        new = Node(N.MatMul, mm.name, [x, wv], [out])
        graph.nodes[graph.nodes.index(drop[-1])] = new
        dead |= {id(n) for n in drop[:-1]}
        found[x.name] = DYNAMIC
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    used = {id(v) for n in graph.nodes for v in n.inputs if v is not None}
    used |= {id(v) for v in graph.outputs}
    graph.nodes = [n for n in graph.nodes if not (
        n.op in (Q.DynamicQuantizeLinear, M.Mul) and not any(id(o) in used for o in n.outputs)
        and (n.op is Q.DynamicQuantizeLinear or any(
            i is not None and i.producer is not None and
            i.producer.op is Q.DynamicQuantizeLinear for i in n.inputs)))]
    if found:
        log(f"dynamic quantization: {len(found)} activation(s) quantized per call, "
            f"{len(dead) // 2} MatMulInteger layer(s) made INT8 layers")
    return found


def fuse_conv_integer_bias(graph: Graph, log=lambda m: None) -> int:
    """A dynamic convolution's bias and rescale as onnxruntime's quantizer writes them (a
    ddddocr model's 21 convolutions), one op instead of eight::

        S = xs * ws      bq = Cast(Floor(Div(B, S)), int32) ──Reshape([1, M, 1, 1])──┐
        ConvInteger(xq, Wq, xz, wz) ─────────────────────────────────────────────── Add
            ──Cast(float)──Mul(·, S)──▶ y
                   ==>  y = ConvIntegerScaled(xq, Wq, xz, wz, B, S)

    (the same steps in the same dtypes, so the same values). Fires for a constant float32
    bias of one value per output channel, a reshape that puts it on the channel dim, the same
    scalar S in the Div and the Mul (or the same product of the same two scales, as the
    quantizer writes it twice), and single readers along the chain; returns the number
    fused."""
    users, dead, done = graph.users(), set(), 0
    for conv in [n for n in graph.nodes if n.op is Q.ConvInteger]:
        m = _match_conv_bias(graph, conv, users)
        if m is None:
            continue
        b, s, mul, chain = m
        ins = list(conv.inputs) + [None] * (4 - len(conv.inputs))
        new = Node(I8.ConvIntegerScaled, f"{conv.name} + bias + scale", [*ins[:4], b, s],
                   list(mul.outputs), I8.ConvIntegerScaled.make_attrs(**{
                       k: getattr(conv.attrs, k) for k in I8.ConvIntegerScaled.attrs}))
        graph.nodes[graph.nodes.index(mul)] = new
        dead |= {id(n) for n in chain}
        done += 1
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    if done:
        log(f"dynamic quantization: {done} ConvInteger layer(s) with their bias and rescale "
            "as one op each")
    return done


def _match_conv_bias(graph: Graph, conv: Node, users):
    """(B, S, the final Mul, the other nodes to drop) or None."""
    from kiln.ops import tensor as T

    rank = len(getattr(conv.outputs[0].type, "shape", None) or ())
    add = single_user(graph, conv.outputs[0], users)
    if add is None or add.op is not M.Add or rank < 3:
        return None
    r = add.inputs[1] if add.inputs[0] is conv.outputs[0] else add.inputs[0]
    rs = r.producer
    shape = _const(rs.inputs[1]) if rs is not None and rs.op is T.Reshape else None
    if shape is None or len(shape) != rank or any(int(d) != 1 for k, d in enumerate(shape)
                                                   if k != 1):
        return None
    casted = rs.inputs[0].producer
    fl = casted.inputs[0].producer if casted is not None and casted.op is Q.Cast else None
    dv = fl.inputs[0].producer if fl is not None and fl.op is M.Floor else None
    if dv is None or dv.op is not M.Div or Q.cast_target(casted.attrs.to) != DType.int32:
        return None
    b, s = dv.inputs
    bias = _const(b)
    if bias is None or bias.dtype != np.float32 or bias.ndim != 1 or \
            int(shape[1]) not in (-1, bias.size):
        return None
    cast = single_user(graph, add.outputs[0], users)
    if cast is None or cast.op is not Q.Cast or Q.cast_target(cast.attrs.to) != DType.float32:
        return None
    mul = single_user(graph, cast.outputs[0], users)
    if mul is None or mul.op is not M.Mul or len(mul.inputs) != 2 or \
            cast.outputs[0] not in mul.inputs or not _scalar(graph, s):
        return None
    other = mul.inputs[1] if mul.inputs[0] is cast.outputs[0] else mul.inputs[0]
    if not _same_value(s, other):
        return None
    pre = [dv, fl, casted, rs]
    if any(single_user(graph, n.outputs[0], users) is None for n in pre):
        return None
    return b, s, mul, [*pre, conv, add, cast]


def _same_value(a, b) -> bool:
    """a and b are one value, or two Muls of the same two inputs (the quantizer writes
    x_scale * w_scale twice: for the bias, and for the rescale)."""
    if a is b:
        return True
    pa, pb = a.producer, b.producer
    return pa is not None and pb is not None and pa.op is M.Mul and pb.op is M.Mul and \
        len(pa.inputs) == 2 and len(pb.inputs) == 2 and (
            (pa.inputs[0] is pb.inputs[0] and pa.inputs[1] is pb.inputs[1]) or
            (pa.inputs[0] is pb.inputs[1] and pa.inputs[1] is pb.inputs[0]))


def _scalar(graph: Graph, s) -> bool:
    """S is one value: a product of scalars (x_scale, a one-value weight scale)."""
    shape = getattr(getattr(s, "type", None), "shape", None)
    if shape is not None and all(isinstance(d, int) for d in shape):
        return int(np.prod(shape, dtype=np.int64)) == 1
    p = s.producer
    return p is not None and p.op is M.Mul and all(
        (i.const is not None and i.const.size == 1) or (
            i.producer is not None and i.producer.op is Q.DynamicQuantizeLinear)
        for i in p.inputs)


def fuse_dynamic_conv(graph: Graph, log=lambda m: None) -> int:
    """The DynamicQuantizeLinear in front of a :func:`fuse_conv_integer_bias` convolution and
    the scale product it feeds, folded into the convolution (one pass over the input and one
    op instead of three: the ops ddddocr's 21 quantized convolutions are made of)::

        xq, xs, xz = DynamicQuantizeLinear(x)      S = Mul(xs, ws)
        ConvIntegerScaled(xq, W, xz, wz, B, S)     ==>   DynamicConvInteger(x, W, wz, B, ws)

    (the same codes, scale and float32 steps). Fires for a constant weight and a constant
    nonzero scalar ``ws``; the DynamicQuantizeLinear and the Mul stay where something else
    reads them. Returns the number fused."""
    replace = {}
    for c in [n for n in graph.nodes if n.op is I8.ConvIntegerScaled]:
        xq, w, xz, wz, b, s = (list(c.inputs) + [None] * 6)[:6]
        dql = xq.producer if xq is not None else None
        mul = s.producer if s is not None else None
        if dql is None or dql.op is not Q.DynamicQuantizeLinear or xz is not dql.outputs[2] or \
                _const(w) is None or mul is None or mul.op is not M.Mul or \
                len(mul.inputs) != 2 or dql.outputs[1] not in mul.inputs:
            continue
        ws = mul.inputs[1] if mul.inputs[0] is dql.outputs[1] else mul.inputs[0]
        wsv = _const(ws)
        if wsv is None or wsv.size != 1 or wsv.dtype != np.float32 or \
                not np.isfinite(wsv).all() or float(wsv.reshape(())) == 0.0 or \
                (wz is not None and _const(wz) is None):
            continue
        replace[id(c)] = Node(I8.DynamicConvInteger, f"{dql.name} + {c.name}",
                              [dql.inputs[0], w, wz, b, ws], list(c.outputs),
                              I8.DynamicConvInteger.make_attrs(**{
                                  k: getattr(c.attrs, k) for k in I8.DynamicConvInteger.attrs}))
    if not replace:
        return 0
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes]
    outputs = {id(v) for v in graph.outputs}
    while True:  # the quantizers and scale products nothing reads any more
        used = {id(v) for n in graph.nodes for v in n.inputs if v is not None} | outputs
        dead = [n for n in graph.nodes if n.op in (Q.DynamicQuantizeLinear, M.Mul) and
                not any(id(o) in used for o in n.outputs) and (
                    n.op is Q.DynamicQuantizeLinear or any(
                        i is not None and i.producer is not None and
                        i.producer.op is Q.DynamicQuantizeLinear for i in n.inputs))]
        if not dead:
            break
        gone = {id(n) for n in dead}
        graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    log(f"dynamic quantization: {len(replace)} ConvInteger layer(s) quantize their input "
        "themselves (DynamicQuantizeLinear folded in)")
    return len(replace)


def fuse_dynamic_matmul_integer(graph: Graph, log=lambda m: None) -> int:
    """A MatMulInteger that :func:`fold_dynamic_quant` left (uint8 weight codes beyond the 7-bit
    grid: ddddocr's classifier), with its quantizer in front and the rescale and bias behind,
    as one op::

        xq, xs, xz = DynamicQuantizeLinear(x)
        MatMulInteger(xq, W, xz, wz) ──Cast(float)──Mul(·, Mul(xs, ws))──(Add(·, B))──▶ y
                   ==>  y = DynamicMatMulInteger(x, W, wz, ws, B)

    (the same integers and float32 steps). Fires for a constant 2-D weight, a constant scalar
    weight zero point, a constant ``ws`` of 1 or N values, a constant bias of N values, and
    single readers along the chain; the quantizer stays where something else reads it.
    Returns the number fused."""
    users, replace, dead = graph.users(), {}, set()
    for mm in [n for n in graph.nodes if n.op is Q.MatMulInteger]:
        ins = list(mm.inputs) + [None] * (4 - len(mm.inputs))
        xq, w, xz, wz = ins[:4]
        dql = xq.producer if xq is not None else None
        wv = _const(w)
        if dql is None or dql.op is not Q.DynamicQuantizeLinear or xz is not dql.outputs[2] or \
                wv is None or wv.ndim != 2 or wv.dtype not in (np.uint8, np.int8) or \
                (wz is not None and (_const(wz) is None or _const(wz).size != 1)):
            continue
        cast = single_user(graph, mm.outputs[0], users)
        if cast is None or cast.op is not Q.Cast or \
                Q.cast_target(cast.attrs.to) != DType.float32:
            continue
        mul = single_user(graph, cast.outputs[0], users)
        if mul is None or mul.op is not M.Mul or len(mul.inputs) != 2:
            continue
        other = mul.inputs[1] if mul.inputs[0] is cast.outputs[0] else mul.inputs[0]
        smul = other.producer
        if smul is None or smul.op is not M.Mul or dql.outputs[1] not in smul.inputs or \
                len(smul.inputs) != 2 or single_user(graph, other, users) is None:
            continue
        ws = smul.inputs[1] if smul.inputs[0] is dql.outputs[1] else smul.inputs[0]
        wsv = _const(ws)
        if wsv is None or wsv.dtype != np.float32 or wsv.size not in (1, wv.shape[1]):
            continue
        last, bias = mul, None
        add = single_user(graph, mul.outputs[0], users)
        if add is not None and add.op is M.Add and len(add.inputs) == 2:
            b = add.inputs[1] if add.inputs[0] is mul.outputs[0] else add.inputs[0]
            bv = _const(b)
            if bv is not None and bv.dtype == np.float32 and bv.shape == (wv.shape[1],):
                last, bias = add, b
        replace[id(last)] = Node(I8.DynamicMatMulInteger, f"{dql.name} + {mm.name}",
                                 [dql.inputs[0], w, wz, ws, bias], list(last.outputs))
        dead |= {id(n) for n in (mm, cast, mul, smul, add if bias is not None else None)
                 if n is not None and n is not last}
    if not replace:
        return 0
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in dead]
    outputs = {id(v) for v in graph.outputs}
    used = {id(v) for n in graph.nodes for v in n.inputs if v is not None} | outputs
    graph.nodes = [n for n in graph.nodes if not (
        n.op is Q.DynamicQuantizeLinear and not any(id(o) in used for o in n.outputs))]
    log(f"dynamic quantization: {len(replace)} MatMulInteger layer(s) with their quantizer, "
        "rescale and bias as one op each")
    return len(replace)
