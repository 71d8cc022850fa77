"""Smoothing (SmoothQuant): a per-channel rescale that moves activation outliers into weights.

Transformers' LayerNorm and GELU outputs carry a few channels many times larger than the rest
(all-MiniLM-L6-v2: max 28 in one channel of a LayerNorm output whose typical value is 1). One
scale per tensor then either spends its 256 codes on the outlier channel (min-max: the other
channels get a handful of codes) or clips it (entropy: the KL divergence over the whole
histogram barely sees one channel's values, but the network depends on them). Both lose
accuracy; on MiniLM the entropy calibrator's mean cosine was 0.968.

For an INT8 layer ``Y = X @ W`` the rewrite ``Y = (X * m) @ (W / m[:, None])`` is exact for
any positive ``m`` per input channel. With ``c = amax(X_k)^alpha / amax(W_k)^(1 - alpha)`` and
``m = 1 / c`` (SmoothQuant's choice, ``alpha = 0.5``) both ``X * m`` and the weight have
flatter channel ranges, and a per-tensor scale for ``X * m`` loses little. SmoothQuant
smooths what a LayerNorm makes (the Q/K/V and FC1 inputs), and so does kiln
(:data:`NORMS`). The weight keeps per-output-channel scales as before. ``X * m`` is one
``Mul`` by a constant per quantized activation (shared by the layers reading it); the float
paths (residuals, LayerNorm) still see ``X``.

Calibration runs twice over the batches when smoothing is on: the first pass measures
``amax(X_k)`` per channel (the last axis), the second feeds ``X * m`` to the calibrator.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, Graph, Node, TensorType, Value
from kiln.ir.rewrite import insert_before
from kiln.ops import math as M

ALPHA = 0.5


def channel_amax(x: np.ndarray) -> np.ndarray:
    """max |x| per channel of the last axis."""
    x = np.asarray(x, np.float32)
    return np.abs(x.reshape(-1, x.shape[-1])).max(axis=0) if x.size else np.zeros(
        x.shape[-1], np.float32)


def _weight_rows(n: Node) -> np.ndarray:
    """``n``'s weight as [K, N] (Gemm with transB: transposed)."""
    from kiln.passes.quantize.int8 import _gemm_w

    return _gemm_w(n)


# producers whose outputs are smoothed: normalizations, as in SmoothQuant (LayerNorm -> Q/K/V
# and LayerNorm -> FC1). Not GELU outputs (FC2's input) nor attention contexts: on MiniLM,
# smoothing them too lost accuracy (the 7-bit weights take the outlier rows badly)
NORMS = {"LayerNormalization", "FusedMatMulLayerNorm", "RMSNormalization",
         "SimplifiedLayerNormalization", "SkipLayerNormalization"}


def smoothable(graph: Graph, names, users=None) -> dict[str, list[Node]]:
    """The activations among ``names`` that a normalization (:data:`NORMS`) makes and whose
    INT8 readers (the layers its scale is for) are all matrix products (MatMul/Gemm and
    their fused forms, 2-D constant weight): name -> those readers. Float readers (a
    residual Add, a LayerNorm) keep reading the activation itself."""
    from kiln.passes.quantize.int8 import CONVS, MATMULS, candidate

    users = graph.users() if users is None else users
    found = {}
    for v in _values(graph, names):
        if v.producer is None or v.producer.op.name not in NORMS:
            continue
        readers = list({id(r): r for r in users.get(id(v), [])}.values())
        int8 = [r for r in readers if (r.op in MATMULS or r.op in CONVS)
                and candidate(r) is None and r.inputs[0] is v]
        if int8 and all(r.op in MATMULS and v not in r.inputs[1:] for r in int8):
            found[v.name] = int8
    return found


def _values(graph: Graph, names) -> list[Value]:
    names, seen, out = set(names), set(), []
    for n in graph.nodes:
        for v in n.outputs:
            if v is not None and v.name in names and v.name not in seen:
                seen.add(v.name)
                out.append(v)
    return out


def factors(x_amax: np.ndarray, readers: list[Node], alpha: float = ALPHA) -> np.ndarray:
    """``m`` (the multiplier of X per channel) from X's channel ranges and its readers'
    weights (the largest |w| of each weight row over all readers)."""
    w_amax = np.max([np.abs(_weight_rows(r)).max(axis=1) for r in readers], axis=0)
    x_amax = np.asarray(x_amax, np.float64)
    ok = (x_amax > 0) & (w_amax > 0)
    c = np.ones_like(x_amax)
    c[ok] = x_amax[ok] ** alpha / w_amax[ok].astype(np.float64) ** (1.0 - alpha)
    c = np.clip(c, 1e-4, 1e4)
    return (1.0 / c).astype(np.float32)


def insert_smoothing(graph: Graph, mult: dict[str, np.ndarray],
                     scales: dict[str, tuple[float, int]], log=lambda m: None) -> int:
    """For each activation in ``mult`` (name -> m): a ``Mul(X, m)`` before its INT8 readers,
    their weights divided by m per row, and the activation's scale moved to the Mul's output
    (``scales`` is updated in place). Returns the number of activations smoothed."""
    users = graph.users()
    todo = smoothable(graph, [k for k in mult if k in scales], users)
    for name, readers in todo.items():
        x = readers[0].inputs[0]
        m = np.asarray(mult[name], np.float32)
        if x.type.shape and x.type.shape[-1] not in (None, len(m)) or \
                any(_weight_rows(r).shape[0] != len(m) for r in readers):
            continue
        mv = graph.add_weight(graph.fresh_name(f"{name}_smooth"), m,
                              TensorType(DType.float32, (len(m),)))
        xs = Value(graph.fresh_name(f"{name}_smoothed"), TensorType(DType.float32, x.type.shape))
        insert_before(graph, readers[0], Node(M.Mul, f"{name}/smooth", [x, mv], [xs]))
        for r in readers:
            w = r.inputs[1]
            trans = r.op.name in ("Gemm", "FusedGemm") and r.attrs.transB
            wn = w.const / (m[None, :] if trans else m[:, None])
            r.inputs[1] = graph.add_weight(graph.fresh_name(f"{w.name}_smoothed"),
                                           wn.astype(np.float32),
                                           TensorType(DType.float32, wn.shape))
            r.inputs[0] = xs
        scales[xs.name] = scales[name]
    if todo:
        log(f"int8: {len(todo)} activation(s) smoothed (per-channel ranges moved into the "
            "weights)")
    return len(todo)

