"""Quantized hand-offs (CUDA INT8/FP8 builds): a tensor that only 8-bit layers read is written as
their codes by the layer that makes it, so nothing but the GEMMs touches it and it is 1 byte
per element in memory instead of 2.

Runs on the lowered graph (after :func:`kiln.builder.precision.lower_precision`), before kernel
selection. Two rewrites:

    P = Int8MatMul/Fp8MatMul(...) -> v -> [8-bit layers reading v as X, one scale]
        ==>  P writes v as the readers' codes (``out_scale``/``out_zero``), the readers take
             codes (``out_float``: the float dtype they compute in)
    LayerNormalization(x, g, b) -> v [-> Mul(v, m): SmoothQuant's multiplier] -> 8-bit layers
        ==>  LayerNormQuant(x, g, b, qmul = m / x_scale) -> (v, codes); the readers take codes,
             the Mul goes; v stays for v's float readers (a residual)

Int8Conv layers hand off the same way as the GEMMs (ResNet's 1x1 -> 3x3 -> 1x1 chains: the
first two write the next one's codes).

A tensor some float op also reads (Attention's input, a residual, a graph output) keeps its
float producer, and its 8-bit readers quantize it in their own prologue (as before). So does a
tensor its 8-bit readers read at different scales or kinds (INT8 and FP8), or through any op
but the smoothing Mul.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kiln.ir import DType, Graph, Node, TensorType, Value
from kiln.ir.rewrite import insert_before
from kiln.ops import int8 as I8
from kiln.ops import math as M
from kiln.ops import nn as N

GEMMS = (I8.Int8MatMul, I8.Fp8MatMul, I8.Int8Conv)  # the layers that take and give codes
FLOAT = (DType.float16, DType.bfloat16, DType.float32)


def _dtype(v: Value | None):
    return getattr(getattr(v, "type", None), "dtype", None)


def _kind(n: Node) -> str:
    return "fp8" if n.op is I8.Fp8MatMul else "int8"


def _scale(n: Node) -> tuple[float, int]:
    a = n.attrs
    return (a.x_scale, 128 if n.op is I8.Fp8MatMul else a.x_zero)


def _unique(nodes) -> list[Node]:
    return list({id(n): n for n in nodes}.values())


def code_readers(graph: Graph, v: Value, users: dict, outputs: set) -> list[Node] | None:
    """v's readers, when every one is an 8-bit GEMM reading v as its X (and nowhere else),
    all of one kind and one scale, v is float and no graph output; else None."""
    if id(v) in outputs or _dtype(v) not in FLOAT:
        return None
    readers = _unique(users.get(id(v), []))
    if not readers:
        return None
    for r in readers:
        if r.op not in GEMMS or r.inputs[0] is not v or any(i is v for i in r.inputs[1:]) \
                or r.attrs.x_scale <= 0:
            return None
    if len({_kind(r) for r in readers}) != 1 or len({_scale(r) for r in readers}) != 1:
        return None
    return readers


def _take_codes(readers: list[Node], codes: Value, float_dtype: DType) -> None:
    for r in readers:
        r.inputs[0] = codes
        r.attrs = dataclasses.replace(r.attrs, out_float=float_dtype.onnx)


def _codes_dtype(kind: str) -> DType:
    return DType.float8e4m3fn if kind == "fp8" else DType.int8


def fuse_handoffs(graph: Graph, log=lambda m: None) -> dict:
    """Apply both rewrites (see the module docstring) in place; returns the counts
    ``{"gemm": GEMM and conv outputs written as codes, "norm": LayerNorms that write
    codes}``."""
    users = graph.users()
    outputs = {id(v) for v in graph.outputs}
    done = {"gemm": 0, "norm": 0}
    for p in list(graph.nodes):
        if p.op in GEMMS and len(p.outputs) == 1 and p.attrs.out_scale <= 0:
            v = p.outputs[0]
            readers = code_readers(graph, v, users, outputs)
            if readers is None or _kind(readers[0]) != _kind(p):
                continue
            s, z = _scale(readers[0])
            fdt = _dtype(v)
            p.attrs = dataclasses.replace(p.attrs, out_scale=s, out_zero=z)
            v.type = TensorType(_codes_dtype(_kind(p)), v.type.shape)
            _take_codes(readers, v, fdt)
            done["gemm"] += 1
        elif p.op is N.LayerNormalization and _norm_quant(graph, p, users, outputs):
            done["norm"] += 1
    if any(done.values()):
        log(f"int8: hand-offs: {done['gemm']} GEMM/conv output(s) and {done['norm']} LayerNorm "
            "output(s) written as their readers' 8-bit codes")
    return done


def _last_axis(n: Node, x: Value) -> bool:
    shape = getattr(x.type, "shape", None)
    ax = n.attrs.axis if n.attrs.axis is not None else -1
    return shape is not None and (ax == -1 or ax == len(shape) - 1) and \
        isinstance(shape[-1], int)


def _norm_quant(graph: Graph, ln: Node, users: dict, outputs: set) -> bool:
    if len(ln.outputs) != 1 or getattr(ln.attrs, "stash_type", 1) not in (None, 1) or \
            not _last_axis(ln, ln.inputs[0]):
        return False
    v = ln.outputs[0]
    c = v.type.shape[-1]
    if _dtype(v) not in FLOAT:
        return False
    direct = [r for r in _unique(users.get(id(v), []))  # (a conv's channels are not last)
              if r.op in GEMMS and r.op is not I8.Int8Conv and r.inputs[0] is v]
    muls = [m for m in _unique(users.get(id(v), [])) if m.op is M.Mul and _smoothing(m, v, c)]
    groups = ([(None, direct)] if direct else []) + [(m, None) for m in muls]
    if len(groups) != 1:  # one set of codes per LayerNorm
        return False
    mul, readers = groups[0]
    if mul is not None:
        readers = code_readers(graph, mul.outputs[0], users, outputs)
    else:
        readers = _direct_readers(v, direct, users)
    if not readers:
        return False
    s, z = _scale(readers[0])
    kind = _kind(readers[0])
    m = np.ones(c, np.float32) if mul is None else np.broadcast_to(
        np.asarray(_const_of(mul, v), np.float32).reshape(-1), (c,))
    qmul = graph.add_weight(graph.fresh_name(f"{v.name}_qmul"),
                            (m.astype(np.float64) / s).astype(np.float32),
                            TensorType(DType.float32, (c,)))
    codes = Value(graph.fresh_name(f"{v.name}_{kind}"),
                  TensorType(_codes_dtype(kind), v.type.shape))
    ins = list(ln.inputs) + [None] * (3 - len(ln.inputs))
    a = I8.LayerNormQuant.make_attrs(epsilon=ln.attrs.epsilon if ln.attrs.epsilon is not None
                                     else 1e-5, zshift=0 if kind == "fp8" else z - 128,
                                     fp8=int(kind == "fp8"))
    new = Node(I8.LayerNormQuant, ln.name, [*ins[:3], qmul], [v, codes], a)
    insert_before(graph, ln, new)
    graph.nodes = [n for n in graph.nodes if n is not ln and n is not mul]
    _take_codes(readers, codes, _dtype(v))
    return True


def _direct_readers(v: Value, direct: list[Node], users: dict) -> list[Node] | None:
    """The 8-bit GEMMs reading a LayerNorm's output directly (others, float ones, may read
    it too: they keep the float output), when all read it as X at one kind and scale."""
    for r in direct:
        if any(i is v for i in r.inputs[1:]) or r.attrs.x_scale <= 0:
            return None
    if len({_kind(r) for r in direct}) != 1 or len({_scale(r) for r in direct}) != 1:
        return None
    return direct


def _const_of(mul: Node, v: Value):
    other = mul.inputs[1] if mul.inputs[0] is v else mul.inputs[0]
    return other.const


def _smoothing(mul: Node, v: Value, c: int) -> bool:
    """A ``Mul(v, m)`` by a constant per channel (or scalar): SmoothQuant's multiplier."""
    if len(mul.inputs) != 2 or v not in mul.inputs:
        return False
    other = mul.inputs[1] if mul.inputs[0] is v else mul.inputs[0]
    k = getattr(other, "const", None)
    if k is None or other.producer is not None:
        return False
    k = np.asarray(k)
    return k.size in (1, c) and (k.ndim <= 1 or k.shape[:-1] == (1,) * (k.ndim - 1)) and \
        tuple(mul.outputs[0].type.shape or ()) == tuple(v.type.shape or ())
