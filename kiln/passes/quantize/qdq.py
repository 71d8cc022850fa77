"""Explicit quantization: Q/DQ pairs in, and QDQ models out.

In (:func:`fold_qdq`, before the optimizer): an activation quantized and dequantized on its way
into a layer carries the scale the model's quantizer chose::

    x ──QuantizeLinear(s, z)──DequantizeLinear(s, z)──▶ MatMul(·, DQ(Wq))
                   ==>  x ──▶ MatMul(·, W)       and x's scale (s, z) recorded

A pair whose every reader is such a layer's activation input is removed and ``(s, z)`` kept
for :func:`kiln.passes.quantize.int8.quantize_graph`,
which turns the layer into an INT8 one with exactly that scale (DQ → op → Q becomes a quantized
op). Weight DequantizeLinears of constants fold into float weights, which the INT8 rewrite
quantizes per channel again. Only per-tensor pairs with constant, equal scales and zero points
on both sides fold; others stay as they are and run as float ops, and so does a pair read by
any other op (an Add, Softmax, an activation-by-activation MatMul): those ops see the rounded
values, as onnxruntime computes them.

Out (:func:`write_qdq`): the ONNX model with a Q/DQ pair (int8, zero point 0) on the input of
every MatMul/Gemm/Conv that kiln quantizes, and its weight stored as int8 codes behind a
per-channel DequantizeLinear, on kiln's weight grid (``W_LEVELS``) so that building the QDQ
model gives back the same INT8 layers.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.ir import DType, Graph, Node
from kiln.ir.rewrite import replace_uses
from kiln.ops import int8 as I8
from kiln.ops import nn as N
from kiln.ops import quant as Q
from kiln.passes.quantize.int8 import W_LEVELS, quantize_weight


def _scalar(v):
    if v is None:
        return None
    c = v.const
    return None if c is None or c.size != 1 else c.reshape(()).item()


def _pair_scale(q, d) -> tuple[float, int] | None:
    """(scale, uint8 zero) of a folding Q -> DQ pair, or None."""
    qs, ds = _scalar(q.inputs[1]), _scalar(d.inputs[1])
    qz = _scalar(q.inputs[2]) if len(q.inputs) > 2 else 0
    dz = _scalar(d.inputs[2]) if len(d.inputs) > 2 else 0
    if qs is None or qs != ds or qz is None or qz != dz or (q.attrs.block_size or 0):
        return None
    codes = getattr(getattr(q.outputs[0], "type", None), "dtype", None)
    if codes is None or codes.name not in ("int8", "uint8"):
        return None
    return float(qs), int(qz) + (128 if codes.name == "int8" else 0)


def fold_qdq(graph: Graph, log=lambda m: None, shared: bool = False
             ) -> dict[str, tuple[float, int]]:
    """Remove activation Q/DQ pairs (see the module docstring); returns the scales they set:
    tensor name -> (scale, uint8 zero point). ``shared`` (``BuilderConfig.qdq_shared_int8``):
    a pair read by weight layers and by other ops too stays for the others, and the weight
    layers read its input with its scale (they quantize it to the same codes)."""
    scales: dict[str, tuple[float, int]] = {}
    outputs = {id(v) for v in graph.outputs}
    users = graph.users()
    dead, kept, split = set(), 0, 0
    for d in [n for n in graph.nodes if n.op is Q.DequantizeLinear]:
        q = d.inputs[0].producer
        if q is None or q.op is not Q.QuantizeLinear or id(d.outputs[0]) in outputs:
            continue
        readers = users.get(id(d.outputs[0]), [])
        sz = _pair_scale(q, d)
        layers = [n for n in readers if _weight_layer_input(n, d.outputs[0])]
        if len(layers) < len(readers):
            kept += 1  # its rounding is part of the model's math for what reads it
            if shared and layers and sz is not None:
                for n in layers:  # (the layers read it as their input 0 only)
                    n.inputs[0] = q.inputs[0]
                scales[q.inputs[0].name] = sz
                split += 1
            continue
        if sz is None:
            continue
        x = q.inputs[0]
        replace_uses(graph, d.outputs[0], x)
        scales[x.name] = sz
        dead.add(id(d))
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    used = {id(v) for n in graph.nodes for v in n.inputs if v is not None} | outputs
    graph.nodes = [n for n in graph.nodes if not (n.op is Q.QuantizeLinear and
                                                  id(n.outputs[0]) not in used)]
    if scales or kept:
        log(f"explicit quantization: {len(dead)} Q/DQ pair(s) folded, {len(scales)} "
            f"activation scale(s) taken from the model; {kept} pair(s) feeding other ops "
            "kept as quantize-dequantize in float"
            + (f", {split} of them also read by INT8 layers on their codes (qdq_shared_int8)"
               if split else ""))
    return scales


def _qdq_params(q, d) -> tuple[float, int, bool] | None:
    """(scale, zero point, signed) of a Q -> DQ pair that one QuantizeDequantize computes:
    per tensor, the same constant scale and zero point on both sides, 8-bit codes, float32 in
    and out. None otherwise."""
    qs, ds = _scalar(q.inputs[1]), _scalar(d.inputs[1])
    qz = _scalar(q.inputs[2]) if len(q.inputs) > 2 and q.inputs[2] is not None else 0
    dz = _scalar(d.inputs[2]) if len(d.inputs) > 2 and d.inputs[2] is not None else 0
    codes = getattr(getattr(q.outputs[0], "type", None), "dtype", None)
    types = [getattr(getattr(v, "type", None), "dtype", None) for v in (q.inputs[0],
                                                                        d.outputs[0])]
    if qs is None or qs != ds or qz is None or qz != dz or (q.attrs.block_size or 0) or \
            getattr(q.attrs, "precision", 0) or codes is None or \
            codes.name not in ("int8", "uint8") or any(t is not DType.float32 for t in types):
        return None
    return float(qs), int(qz), codes.name == "int8"


def fuse_qdq_pairs(graph: Graph, log=lambda m: None) -> int:
    """The Q/DQ pairs :func:`fold_qdq` keeps (read by other ops), each as one op::

        x ──QuantizeLinear(s, z)──DequantizeLinear(s, z)──▶ y   ==>   QuantizeDequantize(x)

    (one pass over x instead of two, and no 8-bit tensor in between). The codes, and so y,
    are the same to the bit. Fires when every reader of the codes is such a DequantizeLinear
    and the codes are not a graph output; returns the number of pairs fused."""
    users = graph.users()
    outputs = {id(v) for v in graph.outputs}
    replace, dead, done = {}, set(), 0
    for q in [n for n in graph.nodes if n.op is Q.QuantizeLinear]:
        readers = users.get(id(q.outputs[0]), [])
        if not readers or id(q.outputs[0]) in outputs or any(
                d.op is not Q.DequantizeLinear or d.inputs[0] is not q.outputs[0] or
                _qdq_params(q, d) is None for d in readers):
            continue
        params = {_qdq_params(q, d) for d in readers}
        if len(params) != 1:
            continue
        s, z, signed = params.pop()
        first = readers[0]
        attrs = I8.QuantizeDequantize.make_attrs(scale=s, zero=z, signed=int(signed))
        replace[id(first)] = Node(I8.QuantizeDequantize, f"{q.name} + {first.name}",
                                  [q.inputs[0]], [first.outputs[0]], attrs)
        dead.add(id(q))
        for d in readers[1:]:
            replace_uses(graph, d.outputs[0], first.outputs[0])
            dead.add(id(d))
        done += len(readers)
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in dead]
    if done:
        log(f"explicit quantization: {done} Q/DQ pair(s) kept for other readers run as "
            "one QuantizeDequantize each")
    return done


def _weight_layer_input(n, v) -> bool:
    """Does ``n`` read ``v`` only as the activation of a MatMul/Gemm/Conv whose weight is a
    constant (or the DequantizeLinear of one) — a layer the INT8 rewrite quantizes with the
    pair's scale? Any other read sees the rounded values, so the pair must stay."""
    if n.op not in (N.MatMul, N.Gemm, N.Conv) or len(n.inputs) < 2 or n.inputs[0] is not v or any(
            x is v for x in n.inputs[1:]):
        return False
    w = n.inputs[1]
    if w is None:
        return False
    if w.const is not None:
        return True
    p = w.producer
    return p is not None and p.op is Q.DequantizeLinear and p.inputs[0].const is not None


def lower_qlinear(graph: Graph, log=lambda m: None, conv: bool = True) -> int:
    """onnxruntime's QOperator layers with a constant weight, in QDQ form, so that
    :func:`fold_qdq` and the INT8 rewrite make them kiln INT8 layers::

        QLinearMatMul(a, sa, za, Wq, sw, zw, sy, zy)
            ==>  QuantizeLinear(MatMul(DQ(a, sa, za), DQ(Wq, sw, zw)), sy, zy)
        QLinearConv(x, sx, zx, Wq, sw, zw, sy, zy, B)
            ==>  QuantizeLinear(Conv(DQ(x), DQ(Wq), B * sx * sw), sy, zy)

    The quantized tensors between such layers become Q -> DQ pairs, which fold; the weight
    keeps its codes (:func:`kiln.passes.quantize.int8.weight_grids`). Fires for constant
    weights and scalar activation scales (QLinearConv only with ``conv``: its QDQ form rounds
    twice where QLinearConv rounds once, see ``BuilderConfig.qlinear_conv_int8``); returns the
    number of layers lowered."""
    from kiln.ir import DType, Node, TensorType, Value
    from kiln.ops import nn as N

    done = 0
    new_nodes = []
    for n in graph.nodes:
        if n.op not in (Q.QLinearMatMul, Q.QLinearConv) or len(n.inputs) < 8 or (
                n.op is Q.QLinearConv and not conv):
            new_nodes.append(n)
            continue
        x, sx, zx, w, sw, zw, sy, zy = n.inputs[:8]
        bias = n.inputs[8] if len(n.inputs) > 8 else None
        conv = n.op is Q.QLinearConv
        if w.const is None or sw.const is None or any(
                v is not None and v.const is None for v in (sx, zx, zw, sy, zy, bias)) or \
                np.size(sx.const) != 1 or np.size(sy.const) != 1:
            new_nodes.append(n)
            continue

        def fresh(base, shape):
            return Value(graph.fresh_name(base), TensorType(DType.float32, shape))

        y = n.outputs[0]
        xf = fresh(f"{x.name}_dequantized", x.type.shape)
        new_nodes.append(Node(Q.DequantizeLinear, f"{n.name}/dq_x", [x, sx, zx], [xf],
                              Q.DequantizeLinear.make_attrs()))
        wf = fresh(f"{w.name}_dequantized", w.const.shape)
        axis = 0 if conv else 1
        new_nodes.append(Node(Q.DequantizeLinear, f"{n.name}/dq_w", [w, sw, zw], [wf],
                              Q.DequantizeLinear.make_attrs(axis=axis if np.size(sw.const) > 1
                                                            else 1)))
        yf = fresh(f"{y.name}_float", y.type.shape)
        if conv:
            ins = [xf, wf]
            if bias is not None:
                b = (bias.const.astype(np.float64) * float(np.asarray(sx.const).ravel()[0])
                     * np.asarray(sw.const, np.float64).ravel()).astype(np.float32)
                ins.append(graph.add_weight(graph.fresh_name(f"{bias.name}_float"), b,
                                            TensorType(DType.float32, b.shape)))
            a = n.attrs
            attrs = N.Conv.make_attrs(**{f: getattr(a, f) for f in (
                "auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
                if hasattr(a, f)})
            new_nodes.append(Node(N.Conv, n.name, ins, [yf], attrs))
        else:
            new_nodes.append(Node(N.MatMul, n.name, [xf, wf], [yf]))
        new_nodes.append(Node(Q.QuantizeLinear, f"{n.name}/q_y", [yf, sy, zy], [y],
                              Q.QuantizeLinear.make_attrs()))
        done += 1
    graph.nodes = new_nodes
    if done:
        log(f"explicit quantization: {done} QLinearMatMul/QLinearConv layer(s) in QDQ form")
    return done


# ---------------------------------------------------------------- writing QDQ models

_WEIGHT_AXIS = {"MatMul": 1, "Conv": 0}


def _weight_axis(node) -> int | None:
    if node.op_type == "Gemm":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0):
            return None
        return 0 if attrs.get("transB", 0) else 1
    return _WEIGHT_AXIS.get(node.op_type)


def write_qdq(model: onnx.ModelProto, scales: dict[str, tuple[float, int]],
              log=lambda m: None, smooth: dict | None = None) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with Q/DQ on the layers whose input has a scale in ``scales``
    (tensor name -> (scale, uint8 zero point): zero 128 is written as int8 codes with zero
    point 0, others as uint8 codes). ``smooth`` (tensor name -> per-channel multipliers
    ``m``, :mod:`kiln.passes.quantize.smooth`): those inputs go through ``Mul(x, m)`` before
    their Q/DQ and the weights are divided by ``m`` per row first. Returns (model, layers)."""
    smooth = smooth or {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise ValueError(f"writing a QDQ model needs opset >= 13 (per-channel "
                         f"DequantizeLinear); the model has opset {opset}")
    new_nodes, done_x, done_w, layers = [], {}, {}, 0
    for node in g.node:
        axis = _weight_axis(node)
        if (axis is not None and len(node.input) > 1 and node.input[0] in scales
                and node.input[1] in inits):
            w = numpy_helper.to_array(inits[node.input[1]])
            if w.dtype == np.float32 and (w.ndim == 2 or node.op_type == "Conv"):
                x = node.input[0]
                m = smooth.get(x) if node.op_type != "Conv" else None
                wkey = node.input[1] if m is None else (node.input[1], x)
                if m is not None:
                    w = w / (m[:, None] if axis == 1 else m[None, :])
                if (x, m is not None) not in done_x:
                    xin = x if m is None else _smooth_mul(g, new_nodes, x, m)
                    done_x[(x, m is not None)] = _qdq_activation(g, new_nodes, xin, scales[x])
                if wkey not in done_w:
                    done_w[wkey] = _qdq_weight(g, new_nodes, node.input[1] if m is None
                                               else f"{node.input[1]}_smoothed", w, axis)
                node.input[0], node.input[1] = done_x[(x, m is not None)], done_w[wkey]
                layers += 1
        new_nodes.append(node)
    del g.node[:]
    g.node.extend(new_nodes)
    still_read = {i for n in g.node for i in n.input}
    for name in {k if isinstance(k, str) else k[0] for k in done_w}:
        if name not in still_read:
            g.initializer.remove(inits[name])
    log(f"QDQ: {layers} layer(s) quantized, {len(done_x)} activation Q/DQ pair(s)"
        + (f", {sum(1 for k in done_x if k[1])} smoothed" if smooth else ""))
    return out, layers


def _smooth_mul(g, nodes, x: str, m: np.ndarray) -> str:
    name = f"{x}_smooth"
    g.initializer.append(numpy_helper.from_array(np.asarray(m, np.float32), name))
    nodes.append(helper.make_node("Mul", [x, name], [f"{x}_smoothed"], name=f"{x}_Smooth"))
    return f"{x}_smoothed"


def _qdq_activation(g, nodes, x: str, scale_zero: tuple[float, int]) -> str:
    scale, zero = scale_zero
    zp = np.array(0, np.int8) if zero == 128 else np.array(zero, np.uint8)
    s, z = f"{x}_scale", f"{x}_zero_point"
    g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), s),
                          numpy_helper.from_array(zp, z)])
    nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [f"{x}_quantized"],
                                  name=f"{x}_QuantizeLinear"))
    nodes.append(helper.make_node("DequantizeLinear", [f"{x}_quantized", s, z],
                                  [f"{x}_dequantized"], name=f"{x}_DequantizeLinear"))
    return f"{x}_dequantized"


def _qdq_weight(g, nodes, name: str, w: np.ndarray, axis: int) -> str:
    q, scale = quantize_weight(w, axis)
    assert np.abs(q).max() <= W_LEVELS
    g.initializer.extend([
        numpy_helper.from_array(q, f"{name}_quantized"),
        numpy_helper.from_array(scale, f"{name}_scale"),
        numpy_helper.from_array(np.zeros(scale.shape, np.int8), f"{name}_zero_point")])
    nodes.append(helper.make_node(
        "DequantizeLinear", [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
        [f"{name}_dequantized"], name=f"{name}_DequantizeLinear", axis=axis))
    return f"{name}_dequantized"


def fuse_requantize(graph: Graph, log=lambda m: None) -> int:
    """An INT8 layer whose output the model quantizes again (QDQ's ``DQ -> MatMul -> Q``,
    which onnxruntime runs as one QLinearMatMul) requantizes its int32 products as
    onnxruntime does, instead of rounding the float product a second time::

        Int8MatMul(x, Wq, ws) ──QuantizeDequantize(sy, zy)──▶ y   ==>   Int8MatMulQDQ(x, Wq, ws)

    (``round(acc * (sx * ws / sy))`` and ``round(acc * sx * ws / sy)`` differ where the
    product falls within an ulp of a half: one code there moves DistilBERT's output by 1e-3).
    Fires for a static activation scale, no bias, residual or activation, and a single
    reader; returns the number of layers fused."""
    users = graph.users()
    outputs = {id(v) for v in graph.outputs}
    replace, dead = {}, set()
    for mm in [n for n in graph.nodes if n.op is I8.Int8MatMul]:
        a = mm.attrs
        readers = users.get(id(mm.outputs[0]), [])
        if len(mm.inputs) != 3 or a.x_scale == 0.0 or a.activation or a.has_residual or \
                len(readers) != 1 or readers[0].op is not I8.QuantizeDequantize or \
                id(mm.outputs[0]) in outputs:
            continue
        qd = readers[0]
        attrs = I8.Int8MatMulQDQ.make_attrs(x_scale=a.x_scale, x_zero=a.x_zero,
                                            y_scale=qd.attrs.scale, y_zero=qd.attrs.zero,
                                            y_signed=qd.attrs.signed)
        replace[id(qd)] = Node(I8.Int8MatMulQDQ, f"{mm.name} + {qd.name}", list(mm.inputs),
                               list(qd.outputs), attrs)
        dead.add(id(mm))
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in dead]
    if replace:
        log(f"explicit quantization: {len(replace)} INT8 layer(s) requantize their output "
            "as QLinearMatMul does")
    return len(replace)


def fuse_qlinear_matmul(graph: Graph, log=lambda m: None) -> int:
    """QDQ's ``DQ -> MatMul -> Q`` where both operands are activations (attention's Q Kᵀ and
    P V: the pairs :func:`fuse_qdq_pairs` made QuantizeDequantize ops), as one integer batched
    matmul, the QLinearMatMul onnxruntime runs there::

        QuantizeDequantize(a) ─┐
        QuantizeDequantize(b) ─┴─ MatMul ── QuantizeDequantize(y)   ==>   QLinearMatMulQDQ(a, b)

    (exact int32 products of the codes, requantized from them as onnxruntime does; the float
    MatMul rounded the dequantized products' sum, which may round a code the other way). An
    operand's QuantizeDequantize stays where something else reads it too. Fires for rank 2-4
    float32 operands and a MatMul whose one reader is the output's QuantizeDequantize (and
    that is not a graph output); returns the number of MatMuls fused."""
    users = graph.users()
    outputs = {id(v) for v in graph.outputs}
    replace, dead = {}, set()
    for mm in [n for n in graph.nodes if n.op is N.MatMul and len(n.inputs) == 2]:
        qa, qb = (v.producer if v is not None else None for v in mm.inputs)
        readers = users.get(id(mm.outputs[0]), [])
        if any(q is None or q.op is not I8.QuantizeDequantize for q in (qa, qb)) or \
                len(readers) != 1 or readers[0].op is not I8.QuantizeDequantize or \
                id(mm.outputs[0]) in outputs:
            continue
        ranks = [len(getattr(getattr(v, "type", None), "shape", None) or ())
                 for v in (qa.inputs[0], qb.inputs[0])]
        types = [getattr(getattr(v, "type", None), "dtype", None)
                 for v in (qa.inputs[0], qb.inputs[0])]
        if any(not 2 <= r <= 4 for r in ranks) or any(t is not DType.float32 for t in types):
            continue
        qy = readers[0]
        attrs = I8.QLinearMatMulQDQ.make_attrs(**{
            f"{t}_{f}": getattr(q.attrs, f) for t, q in (("a", qa), ("b", qb), ("y", qy))
            for f in ("scale", "zero", "signed")})
        replace[id(qy)] = Node(I8.QLinearMatMulQDQ, f"{mm.name} + {qy.name}",
                               [qa.inputs[0], qb.inputs[0]], list(qy.outputs), attrs)
        dead.add(id(mm))
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in dead]
    if replace:  # operand pairs nothing reads any more
        used = {id(v) for n in graph.nodes for v in n.inputs if v is not None} | outputs
        graph.nodes = [n for n in graph.nodes if not (
            n.op is I8.QuantizeDequantize and id(n.outputs[0]) not in used)]
        log(f"explicit quantization: {len(replace)} MatMul(s) of two quantized activations "
            "as integer batched matmuls (QLinearMatMul's arithmetic)")
    return len(replace)
