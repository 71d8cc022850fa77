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
