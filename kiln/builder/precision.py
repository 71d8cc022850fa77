"""Reduced precision: run an optimized graph's float32 math in FP16 or BF16.

:func:`lower_precision` rewrites the graph in place, after the optimizer and before kernel
selection (the Builder calls it when ``BuilderConfig.fp16`` or ``bf16`` is set):

- Every node runs in the low precision unless it is *pinned* to FP32: its op is in
  :data:`FP32_OPS`, its name is in ``keep_fp32``, it owns subgraphs (If/Loop/Scan run as FP32
  islands), or its shape rule says it would not produce the low type from low inputs (an output
  dtype fixed by an attribute, as for RandomNormal).
- Cast(to=float32) and ConstantOfShape(float32 value) inside a low region are retargeted.
- float32 weights and constants read by low nodes are converted, so the engine stores them in
  the precision they run in; a weight read by both kinds of node is stored twice.
- Casts go where a value crosses between the two: after float32 graph inputs, before float32
  graph outputs (the output keeps its name and dtype: the engine's I/O dtypes stay as the model
  declares them), and around pinned nodes. Values of other dtypes (int, float64, float16 already
  in the model) are never touched.

Where FP32 is kept for accuracy, and how:

- By kernels that accumulate in FP32 (no Casts): Softmax/LogSoftmax (ATen accumulates
  reduced-precision softmax in float), Attention (SDPA accumulates in float), MatMul/Gemm/Conv
  (cuBLAS/cuDNN accumulate FP16 products in FP32), and the normalizations: LayerNormalization,
  GroupNormalization and RMSNormalization compute their statistics in ``stash_type`` (FP32)
  inside kiln's kernels, and their scale/bias stay FP32 (:data:`FP32_INPUTS`).
- By Casts around the node: the ops in :data:`FP32_OPS`, whose results overflow FP16's range
  (65504) on ordinary activations: sums and powers, e.g. the variance of an unfused LayerNorm.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from kiln.ir import DType, Graph, InferCtx, Node, TensorType, Value
from kiln.ops import int8 as I8
from kiln.ops import math as M
from kiln.ops import nn as N
from kiln.ops import quant as Q
from kiln.ops import random as RND
from kiln.ops import reduce as R
from kiln.ops import tensor as T
from kiln.ops import vision as V
from kiln.passes.verifier import verify

LOW = {"fp16": DType.float16, "bf16": DType.bfloat16}
F32 = DType.float32

# ops that run in FP32 between Casts: overflow-prone sums and powers, value-sensitive ops
FP32_OPS = frozenset({
    M.Pow, M.Exp, R.ReduceSum, R.ReduceSumSquare, R.ReduceL1, R.ReduceL2, R.ReduceLogSum,
    R.ReduceLogSumExp, R.ReduceProd, T.Range, Q.QuantizeLinear, Q.DequantizeLinear,
    Q.DynamicQuantizeLinear, RND.RandomUniform, RND.RandomNormal, RND.RandomUniformLike,
    RND.RandomNormalLike, RND.Bernoulli, RND.Multinomial,
    # quantized ops defined by onnxruntime's float32 steps (their inputs' codes, scales)
    I8.QLinearMatMulQDQ, I8.DynamicConvInteger, I8.DynamicMatMulInteger,
})

# float32 inputs that stay float32 on low-precision nodes: the kernel casts them itself
# (normalization parameters, computed with in FP32) or reads them as values (Resize scales)
FP32_INPUTS: dict = {
    N.LayerNormalization: (1, 2), N.GroupNormalization: (1, 2), N.RMSNormalization: (1,),
    V.Resize: (1, 2), V.Upsample: (1,),
    # INT8/FP8 layers take and give the low precision; their weight scales stay float32
    I8.Int8MatMul: (2,), I8.Int8MatMulQDQ: (2,), I8.Int8Conv: (2,), I8.Fp8MatMul: (2,),
}


def lower_precision(graph: Graph, precision: str = "fp16", keep_fp32=(),
                    log: Callable[[str], None] = lambda m: None, io: bool = False) -> dict:
    """Rewrite ``graph`` (in place) to run in ``precision`` ("fp16" or "bf16").

    ``keep_fp32``: names of nodes to pin to FP32. ``io``: the graph's float32 inputs and
    outputs take the low precision too (as trtexec's ``--inputIOFormats``/
    ``--outputIOFormats``): no Cast at the edges, and the caller passes and gets low-precision
    tensors. Returns counts: ``low`` (nodes in the low precision), ``fp32`` (float nodes
    pinned to FP32, by name), ``casts`` (Casts inserted), ``weights`` (weights converted)."""
    if precision not in LOW:
        raise ValueError(f"precision must be one of {sorted(LOW)}, not {precision!r}")
    return _Lowering(graph, LOW[precision], set(keep_fp32), io).run(log)


class _Lowering:
    def __init__(self, graph: Graph, low: DType, keep: set[str], io: bool = False):
        self.g, self.low, self.keep, self.io = graph, low, keep, io
        self.orig: dict[int, DType | None] = {id(v): _dtype(v) for v in _all_values(graph)}
        self.names = {v.name for v in _all_values(graph)} | {n.name for n in graph.nodes}
        self.converted: dict[tuple[int, DType], Value] = {}
        self.stats = {"low": 0, "fp32": [], "casts": 0, "weights": 0}

    def run(self, log) -> dict:
        if self.io:
            for v in self.g.inputs:
                if self.orig.get(id(v)) == F32:
                    v.type = TensorType(self.low, getattr(v.type, "shape", None))
        lows = {id(n) for n in self.g.nodes if self._lower_node(n)}
        out: list[Node] = []
        for n in self.g.nodes:
            for i, v in enumerate(n.inputs):
                want = self._wanted(n, i, v, id(n) in lows)
                if want is not None and want != _dtype(v):
                    n.inputs[i] = self._convert(v, want, out)
            out.append(n)
        self.g.nodes = out
        io_type = self.low if self.io else F32
        for i, v in enumerate(self.g.outputs):
            if self.orig.get(id(v)) == F32 and _dtype(v) != io_type:
                self.g.outputs[i] = self._convert(v, io_type, self.g.nodes, keep_name=True)
        self._drop_unused_weights()
        verify(self.g, after="lower_precision")
        s = self.stats
        log(f"precision {self.low.name}: {s['low']} layer(s) in {self.low.name}, "
            f"{len(s['fp32'])} pinned to float32, {s['casts']} Cast(s) inserted, "
            f"{s['weights']} weight(s) converted")
        return s

    # ---- which nodes run low

    def _lower_node(self, n: Node) -> bool:
        """Decide ``n``'s precision; a low node has its attributes and float32 outputs retyped."""
        floats = [v for v in n.inputs + n.outputs if v is not None and self.orig.get(id(v)) == F32]
        if not floats:
            return False
        if n.op in FP32_OPS or n.name in self.keep or n.subgraphs():
            self.stats["fp32"].append(n.name)
            return False
        attrs = self._retarget(n)
        ins = [None if v is None else self._in_type(n, i, v) for i, v in enumerate(n.inputs)]
        ctx = InferCtx(attrs, ins, [None if v is None else v.const for v in n.inputs],
                       [None if v is None else v.sym for v in n.inputs], len(n.outputs))
        try:
            types = list(n.op.infer(ctx)) if n.op.infer is not None else None
        except Exception:  # a rule that cannot say: keep the node as it was
            types = None
        if types is None or len(types) < len(n.outputs) or any(
                getattr(t, "dtype", None) != self._out_dtype(o)
                for o, t in zip(n.outputs, types)):
            self.stats["fp32"].append(n.name)
            return False
        n.attrs = attrs
        for o in n.outputs:
            if self.orig.get(id(o)) == F32:
                o.type = TensorType(self.low, o.type.shape)
        self.stats["low"] += 1
        return True

    def _out_dtype(self, v: Value):
        return self.low if self.orig.get(id(v)) == F32 else _dtype(v)

    def _in_type(self, n: Node, i: int, v: Value):
        if self.orig.get(id(v)) == F32 and i not in FP32_INPUTS.get(n.op, ()):
            return TensorType(self.low, getattr(v.type, "shape", None))
        return v.type

    def _retarget(self, n: Node):
        """The attributes a low node runs with: float32 targets become the low dtype."""
        a = n.attrs
        if n.op is Q.Cast and Q.cast_target(a.to) == F32:
            return dataclasses.replace(a, to=self.low.onnx)
        if n.op is T.ConstantOfShape and a.value is not None and \
                np.asarray(a.value).dtype == np.float32:
            return dataclasses.replace(a, value=np.asarray(a.value).astype(self.low.np))
        if getattr(a, "out_types", None):  # fused ops that carry their output types
            return dataclasses.replace(a, out_types=tuple(
                TensorType(self.low, t.shape) if t.dtype == F32 else t for t in a.out_types))
        return a

    # ---- what each input needs

    def _wanted(self, n: Node, i: int, v: Value | None, low: bool) -> DType | None:
        if v is None or self.orig.get(id(v)) != F32:
            return None
        if low and i not in FP32_INPUTS.get(n.op, ()):
            return self.low
        return F32

    def _convert(self, v: Value, want: DType, out: list[Node], keep_name: bool = False) -> Value:
        key = (id(v), want)
        if key in self.converted and not keep_name:
            return self.converted[key]
        shape = getattr(v.type, "shape", None)
        if v.const is not None and v.producer is None and not keep_name:
            c = Value(self._fresh(f"{v.name}__{want.name}"), TensorType(want, shape),
                      const=np.asarray(v.const).astype(want.np))
            if any(w is v for w in self.g.weights.values()):
                self.g.weights[c.name] = c
                self.stats["weights"] += 1
        elif keep_name or (want == F32 and not any(v is i for i in self.g.inputs)):
            # the cast takes the value's name (outputs and subgraph captures are matched by
            # name); the value it reads is renamed. Graph inputs keep theirs.
            c = Value(v.name, TensorType(want, shape))
            v.name = self._fresh(f"{v.name}__{_dtype(v).name}")
            out.append(self._cast_node(v, c, want))
        else:
            c = Value(self._fresh(f"{v.name}__{want.name}"), TensorType(want, shape))
            out.append(self._cast_node(v, c, want))
        self.converted[key] = c
        self.orig[id(c)] = F32
        return c

    def _cast_node(self, src: Value, dst: Value, to: DType) -> Node:
        self.stats["casts"] += 1
        name = self._fresh(f"{dst.name}/cast_{to.name}")
        return Node(Q.Cast, name, [src], [dst], Q.Cast.make_attrs(to=to.onnx))

    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        self.names.add(name)
        return name

    def _drop_unused_weights(self) -> None:
        used = {id(v) for n in self.g.nodes for v in n.inputs if v is not None}
        used |= {id(v) for v in self.g.outputs}
        for name in [k for k, w in self.g.weights.items() if id(w) not in used]:
            del self.g.weights[name]


def _dtype(v: Value | None):
    return getattr(getattr(v, "type", None), "dtype", None)


def _all_values(g: Graph):
    yield from g.values()
    for n in g.nodes:
        for v in n.inputs:
            if v is not None and v.producer is None:
                yield v
