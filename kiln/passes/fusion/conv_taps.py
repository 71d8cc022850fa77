"""Simplification: the taps of a convolution window that only ever read padding are dropped.

    x [N, C, 16, 16] ──Conv(W [K, C, 3, 3], dilations 24, pads 24)──▶ y
        ==>  x ──Conv(W[:, :, 1:2, 1:2] [K, C, 1, 1], dilations 1, pads 0)──▶ y
                                                                "conv dead taps"

A dilated convolution on a map smaller than its dilation (DeepLabV3's ASPP: rates 12, 24 and 36
on the 16 x 16 or 32 x 32 features of a 256- or 512-pixel image) has window taps that fall in
the zero padding for every output pixel: they multiply zeros. Along each spatial axis, with
input size I, output size O, stride s, dilation d and begin pad p, tap k reads input rows
``o s - p + k d`` for o in [0, O); it is dead when all of them lie outside [0, I). The live taps
of an axis are one run [k0, k1] (both bounds of the rows it reads grow with k), so the weight is
sliced to that run and the begin pad lowered by ``k0 d``, which keeps every output reading the
same input rows with the same weights; the end pad is what gives the same O (none where the
last window now ends inside the input: a stride that skips the last rows). An axis left with
one tap gets dilation 1. The sum each output forms loses only its ``0 * w`` terms (no bit of a
finite result changes; a NaN or inf weight of a dead tap no longer turns a zero into NaN, which
no trained model has). The ASPP's rate-24 and -36 branches become 1x1 convs (GEMMs: 9x fewer
multiply-adds than the 3x3 ones, which onnxruntime and kiln computed in full).

Conditions: the weight is a constant, the input's spatial dims are known integers (a profile
fixes them), ``auto_pad`` is NOTSET, and the new pads are non-negative.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from kiln.ir import Graph
from kiln.ops import nn as N
from kiln.passes.fusion.match import Users, add_const, const_of, reject


def live_taps(size: int, out: int, k: int, stride: int, dil: int, pad: int) -> tuple[int, int]:
    """The run [k0, k1] of the window's taps along one axis that read an input row for some
    output (k0 > k1: none does)."""
    def live(t: int) -> bool:
        first = -pad + t * dil  # the row output 0 reads with tap t
        last = (out - 1) * stride - pad + t * dil
        return first <= size - 1 and last >= 0
    taps = [t for t in range(k) if live(t)]
    return (taps[0], taps[-1]) if taps else (1, 0)


def drop_dead_taps(graph: Graph, log: Callable[[str], None]) -> int:
    """Conv with window taps that only read padding => Conv with a smaller window."""
    users, n = Users(graph), 0
    for conv in list(graph.nodes):
        if conv.op is not N.Conv or len(conv.inputs) < 2:
            continue
        x, wv = conv.inputs[0], conv.inputs[1]
        shape = getattr(x.type, "shape", None) if x is not None else None
        w = const_of(wv)
        if w is None or shape is None or len(shape) < 3 or w.ndim != len(shape):
            continue
        sp = shape[2:]
        a = conv.attrs
        k_sp = list(w.shape[2:])
        n_sp = len(k_sp)
        strides = list(a.strides or [1] * n_sp)
        dil = list(a.dilations or [1] * n_sp)
        pads = list(a.pads or [0] * (2 * n_sp))
        if not all(isinstance(d, int) for d in sp):
            continue
        if (a.auto_pad or "NOTSET") != "NOTSET":
            continue
        outs = [(sp[i] + pads[i] + pads[n_sp + i] - (k_sp[i] - 1) * dil[i] - 1) // strides[i] + 1
                for i in range(n_sp)]
        if any(o <= 0 for o in outs):
            continue
        runs = [live_taps(sp[i], outs[i], k_sp[i], strides[i], dil[i], pads[i])
                for i in range(n_sp)]
        if all(r == (0, k - 1) for r, k in zip(runs, k_sp)):
            continue
        if any(k0 > k1 for k0, k1 in runs):  # every tap reads padding: leave it to the kernels
            continue
        begin = [pads[i] - runs[i][0] * dil[i] for i in range(n_sp)]
        new_k = [k1 - k0 + 1 for k0, k1 in runs]
        new_dil = [1 if new_k[i] == 1 else dil[i] for i in range(n_sp)]
        # the end pad that makes the last output's window end where it did, or none where
        # that window ends inside the input (a stride past the last rows: floor division
        # still gives O outputs, checked)
        end = [max(0, (outs[i] - 1) * strides[i] + (new_k[i] - 1) * new_dil[i] + 1 - sp[i]
                   - begin[i]) for i in range(n_sp)]
        same = all((sp[i] + begin[i] + end[i] - (new_k[i] - 1) * new_dil[i] - 1) // strides[i]
                   + 1 == outs[i] for i in range(n_sp))
        if any(p < 0 for p in begin) or not same:
            reject(log, "conv dead taps", conv, f"the smaller window would need pads {begin + end} "
                   "that ONNX's Conv cannot take or that change the output size")
            continue
        sl = (slice(None), slice(None), *(slice(k0, k1 + 1) for k0, k1 in runs))
        w2 = add_const(graph, f"{wv.name}_taps", w[sl])
        conv.inputs[1] = w2
        conv.attrs = dataclasses.replace(
            a, pads=tuple(begin + end), dilations=tuple(new_dil),
            kernel_shape=tuple(new_k) if a.kernel_shape is not None else None)
        users.refresh()
        if not users.of(wv) and graph.weights.get(wv.name) is wv:  # the full window's weight
            del graph.weights[wv.name]
        log(f"{conv.name}: conv dead taps: window {'x'.join(map(str, k_sp))} -> "
            f"{'x'.join(map(str, new_k))} (input {'x'.join(map(str, sp))}, dilations {dil})")
        n += 1
    return n


PASSES = [("drop_dead_conv_taps", drop_dead_taps)]
