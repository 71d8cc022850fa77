"""INT8: float layers with constant weights become INT8 layers (kiln.ops.int8).

Runs on the optimized graph, after calibration gave each activation a scale:

    FusedMatMul(x, W, b, r)            ==>  Int8MatMul(x, Wq, w_scale, b, r)
    MatMul(x, W) / Gemm(x, W, c)       ==>  Int8MatMul(x, Wq, w_scale, c)      (transB: W^T)
    FusedMatMulLayerNorm(x, W, b, r)   ==>  Int8MatMul(x, Wq, w_scale, b, r) -> LayerNorm
    Conv / FusedConv (2-D)             ==>  Int8Conv(x, Wq, w_scale, b, r)

Activations are quantized per tensor (``x_scale``, ``x_zero``; symmetric from calibration:
``x_scale = amax / 127``, ``x_zero = 128`` on uint8 codes), weights per output channel to
``W_LEVELS`` levels each side of zero. A layer stays in float when it is pinned (``keep``),
when its input has no scale, or when its shape is one the INT8 kernels do not take; the log
names each such layer and why.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kiln.ir import DType, Graph, Node, TensorType, Value
from kiln.ir.rewrite import insert_before
from kiln.ops import fused_conv as FC
from kiln.ops import int8 as I8
from kiln.ops import nn as N

# Weights use 7 bits (+-63): on AVX2 without VNNI the u8s8 kernels add pairs of u8 x s8 products
# in int16 with saturation (vpmaddubsw); 255 * 63 * 2 < 32767 never saturates, 255 * 127 * 2 does
W_LEVELS = 63
X_LEVELS = 127
X_ZERO = 128  # symmetric activations on uint8 codes: 0.0 is code 128

MATMULS = (N.MatMul, N.Gemm, FC.FusedMatMul, FC.FusedGemm, FC.FusedMatMulLayerNorm)
CONVS = (N.Conv, FC.FusedConv)


def layer_matches(node_name: str, names) -> bool:
    """Whether a (possibly fused, ``"a + b"``) layer is named in ``names``, whole or by part."""
    return node_name in names or any(p in names for p in node_name.split(" + "))


def candidate(n: Node) -> str | None:
    """Why ``n`` cannot run in INT8, or None when it can (given a scale for its input)."""
    if n.op not in MATMULS and n.op not in CONVS:
        return "no INT8 kernel for this op"
    x = n.inputs[0]
    w = n.inputs[1] if len(n.inputs) > 1 else None
    if x is None or getattr(x.type, "dtype", None) is not DType.float32:
        return "input is not float32"
    if w is None or w.const is None or w.const.dtype != np.float32:
        return "weight is not a float32 constant"
    if n.op in MATMULS:
        if w.const.ndim != 2:
            return "weight is not 2-D"
        if n.op in (N.Gemm, FC.FusedGemm):
            a = n.attrs  # FusedGemm's alpha/beta are its activation's parameters
            if a.transA or (n.op is N.Gemm and (a.alpha != 1.0 or a.beta != 1.0)):
                return "Gemm with transA or alpha/beta != 1"
            c = n.inputs[2] if len(n.inputs) > 2 else None
            if c is not None and (c.const is None or c.const.size != _gemm_w(n).shape[1]):
                return "Gemm bias is not a constant per output"
        return None
    if w.const.ndim != 4:
        return "convolution is not 2-D"
    return None


def _gemm_w(n: Node) -> np.ndarray:
    w = n.inputs[1].const
    return w.T if n.op in (N.Gemm, FC.FusedGemm) and n.attrs.transB else w


def quantize_weight(w: np.ndarray, axis: int,
                    grid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel symmetric INT8 along ``axis``: (codes int8, scale float32 per channel).

    ``grid``: scales the model's own quantizer used (see :func:`weight_grids`). A channel
    that already lies on one of them (every value ``code * scale`` with an integer code in
    [-128, 127]: a weight dequantized from an onnxruntime-quantized model) keeps those codes
    and that scale, so that the layer computes what the quantized model asked for instead of
    rounding its weight a second time onto kiln's 7-bit grid."""
    other = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=other) if other else np.abs(w)
    scale = np.where(amax > 0, amax / W_LEVELS, 1.0).astype(np.float32)
    if grid is not None and len(grid):
        scale = np.where(np.isnan(g := _on_grid(np.moveaxis(w, axis, -1).reshape(
            -1, w.shape[axis]), amax, grid)), scale, g).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -128, 127).astype(np.int8)
    return q, scale


def _on_grid(w2: np.ndarray, amax: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Per column of ``w2`` ([K, N]): the scale of ``grid`` it lies on, NaN where none. The
    largest code of a column is tried from 127 down to 1: its scale is ``amax / code``."""
    found = np.full(w2.shape[1], np.nan, np.float32)
    grid = np.sort(np.asarray(grid, np.float64))
    for code in range(128, 0, -1):
        todo = np.isnan(found) & (amax > 0)
        if not todo.any():
            break
        s = amax[todo].astype(np.float64) / code
        i = np.clip(np.searchsorted(grid, s), 1, len(grid) - 1)
        near = np.where(np.abs(grid[i] - s) < np.abs(grid[i - 1] - s), grid[i], grid[i - 1])
        close = np.abs(near - s) <= 1e-6 * s
        if not close.any():
            continue
        cols = np.flatnonzero(todo)[close]
        q = w2[:, cols] / near[close].astype(np.float32)
        ok = (np.abs(q - np.rint(q)) <= 1e-3).all(axis=0) & (np.abs(q) <= 128.001).all(axis=0)
        found[cols[ok]] = near[close][ok]
    return found


def weight_grids(graph: Graph) -> np.ndarray:
    """The weight scales of a quantized model (before its dequantizations fold into float
    weights): every constant scale of a DequantizeLinear of constant integer codes, and of the
    ``Mul`` that dequantizes a MatMulInteger/ConvInteger (onnxruntime's dynamic format)."""
    from kiln.ops import math as M
    from kiln.ops import quant as Q

    found: list[np.ndarray] = []
    for n in graph.nodes:
        if n.op is Q.DequantizeLinear and len(n.inputs) > 1:
            x, s = n.inputs[0], n.inputs[1]
            if x is not None and x.const is not None and x.const.dtype.kind in "iu" and \
                    s is not None and s.const is not None:
                found.append(np.asarray(s.const, np.float32).ravel())
        elif n.op is M.Mul:
            prods = [i.producer for i in n.inputs if i is not None]
            if any(p is not None and p.op is Q.DynamicQuantizeLinear for p in prods):
                found += [np.asarray(i.const, np.float32).ravel() for i in n.inputs
                          if i is not None and i.const is not None]
    return np.unique(np.concatenate(found)) if found else np.zeros(0, np.float32)


def scales_from_amax(amax: dict[str, float], mins: dict[str, float] | None = None,
                     maxs: dict[str, float] | None = None) -> dict[str, tuple[float, int]]:
    """Calibrated ranges -> (scale, zero) on uint8 codes: symmetric (``amax / 127``, zero
    128), or with ``mins``/``maxs`` asymmetric: the 256 codes cover ``[max(min, -amax),
    min(max, amax)]`` (always holding 0) instead of ``[-amax, amax]``: twice the resolution
    for one-sided tensors (GELU/ReLU outputs), more for skewed ones (BERT's LayerNorm
    outputs)."""
    out = {}
    for k, a in amax.items():
        a = max(float(a), 1e-8)
        if mins is None:
            out[k] = (a / X_LEVELS, X_ZERO)
            continue
        lo = min(0.0, max(mins.get(k, -a), -a))
        hi = max(0.0, min((maxs or {}).get(k, a), a))
        s = max(hi - lo, 1e-8) / 255.0
        out[k] = (s, min(255, int(round(-lo / s))))
    return out


E4M3_MAX = 448.0


def quantize_weight_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-column float8 e4m3 weights of a [K, N] matrix: (codes, scale per column)."""
    import ml_dtypes

    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    return np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn), scale


def quantize_graph(graph: Graph, scales: dict[str, tuple[float, int]], keep=(),
                   log=lambda m: None, fp8: bool = False, grid=None) -> dict:
    """Rewrite every layer that can run in INT8 (see the module docstring), in place.

    ``scales``: activation tensor name -> (scale, uint8 zero point). ``keep``: layer names
    (or parts of fused names) that stay in float. ``fp8``: matrix products become
    Fp8MatMul layers instead (scale ``amax / 448`` from the same calibration; convolutions
    stay in float). ``grid``: the model's own weight scales (:func:`weight_grids`), kept
    where a weight lies on them. Returns ``{"int8": [names], "float": {name: reason}}``."""
    keep = set(keep)
    done, kept = [], {}
    for n in list(graph.nodes):
        why = candidate(n)
        if why == "no INT8 kernel for this op":
            continue
        if why is None and layer_matches(n.name, keep):
            why = "pinned by --layer-precision"
        if why is None and n.inputs[0].name not in scales:
            why = f"no scale for its input {n.inputs[0].name}"
        if why is None and fp8 and n.op in CONVS:
            why = "no FP8 convolution kernel"
        if why is not None:
            kept[n.name] = why
            continue
        _rewrite(graph, n, scales[n.inputs[0].name], fp8, grid)
        done.append(n.name)
    _drop_unused_weights(graph)
    log(f"int8: {len(done)} layer(s) in {'FP8' if fp8 else 'INT8'}, {len(kept)} with a weight "
        "kept in float")
    for name, why in kept.items():
        log(f"int8: layer '{name}' kept in float: {why}")
    return {"int8": done, "float": kept}


def _epilogue(a) -> dict:
    return {k: getattr(a, k) for k in ("activation", "alpha", "beta", "has_residual")
            if hasattr(a, k)}


def _rewrite(graph: Graph, n: Node, xs: tuple[float, int], fp8: bool = False,
             grid=None) -> None:
    scale, zero = xs
    if n.op in CONVS:
        wq, ws = quantize_weight(n.inputs[1].const, 0, grid)
        a = n.attrs
        conv = {f.name: getattr(a, f.name) for f in dataclasses.fields(I8.Int8Conv.Attrs)
                if hasattr(a, f.name) and f.name not in ("x_scale", "x_zero")}
        conv["layout"] = ""
        attrs = I8.Int8Conv.make_attrs(x_scale=scale, x_zero=zero, **conv)
        new = Node(I8.Int8Conv, n.name, [n.inputs[0], *_weights(graph, n, wq, ws),
                                         *n.inputs[2:]], n.outputs, attrs)
        _replace(graph, n, [new])
        return
    if fp8:
        wq, ws = quantize_weight_fp8(_gemm_w(n))
    else:
        wq, ws = quantize_weight(_gemm_w(n), 1, grid)
    rest = list(n.inputs[2:])
    if n.op is FC.FusedMatMulLayerNorm:  # inputs x, W, b, r, scale, ln_bias
        rest, ln_in = rest[:2], rest[2:]
    ep = _epilogue(n.attrs) if n.op not in (N.MatMul, N.Gemm) else {}
    op = I8.Fp8MatMul if fp8 else I8.Int8MatMul
    if fp8 and scale == 0.0:
        raise ValueError(f"layer '{n.name}': FP8 layers need calibrated scales, not dynamic")
    if fp8:  # the symmetric INT8 scale amax / 127, as an e4m3 one: amax / 448
        attrs = op.make_attrs(x_scale=scale * X_LEVELS / E4M3_MAX, **ep)
    else:
        attrs = op.make_attrs(x_scale=scale, x_zero=zero, **ep)
    while rest and rest[-1] is None:
        rest.pop()
    ins = [n.inputs[0], *_weights(graph, n, wq, ws), *rest]
    if n.op is not FC.FusedMatMulLayerNorm:
        _replace(graph, n, [Node(op, n.name, ins, n.outputs, attrs)])
        return
    out = n.outputs[0]
    mid = Value(graph.fresh_name(f"{out.name}_int8"), TensorType(DType.float32, out.type.shape))
    mm = Node(op, n.name, ins, [mid], attrs)
    ln = Node(N.LayerNormalization, f"{n.name}/layernorm", [mid, *ln_in], [out],
              N.LayerNormalization.make_attrs(axis=-1, epsilon=n.attrs.epsilon))
    _replace(graph, n, [mm, ln])


def _weights(graph: Graph, n: Node, wq: np.ndarray, ws: np.ndarray) -> list[Value]:
    base = n.inputs[1].name
    dt = DType.int8 if wq.dtype == np.int8 else DType.float8e4m3fn
    q = graph.add_weight(graph.fresh_name(f"{base}_{dt.name}"), wq, TensorType(dt, wq.shape))
    s = graph.add_weight(graph.fresh_name(f"{base}_scale"), ws,
                         TensorType(DType.float32, ws.shape))
    return [q, s]


def _replace(graph: Graph, old: Node, new: list[Node]) -> None:
    for x in new:
        insert_before(graph, old, x)
    graph.nodes = [x for x in graph.nodes if x is not old]


def _drop_unused_weights(graph: Graph) -> None:
    used = {id(v) for n in graph.nodes for v in n.inputs if v is not None}
    used |= {id(v) for v in graph.outputs}
    for name in [k for k, w in graph.weights.items() if id(w) not in used]:
        del graph.weights[name]
