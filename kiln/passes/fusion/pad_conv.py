"""Fusion: an explicit zero Pad before a convolution or average pool becomes the op's own pads.

    x ──Pad(pads, 0)──▶ xp ──Conv(pads=p)──▶ y      ==>     x ──Conv(pads=p + spatial pads)──▶ y
                                                            "pad + conv"

TF-style "same" padding exports (timm's ``tf_`` models, TF and Paddle converters) write a Pad
before every strided or depthwise conv; once the profile's dims are fixed its pads are constant.
The conv's implicit padding is zeros, so the two compose by adding the spatial pads
(``Conv(Pad(x, a), pads=b) = Conv(x, pads=a + b)``). Conditions: the Pad is ``constant`` mode
with value 0, its pads constant and non-negative and zero on the batch and channel axes, its
output read by the conv alone (as data) and no graph output; the conv's ``auto_pad`` is NOTSET.
An AveragePool takes the pad only when it counts padding in its average
(``count_include_pad=1``) or has no pads of its own (then it is switched to count them): zeros
the Pad wrote are part of the mean. MaxPool would pad with -inf, so it is left alone.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from kiln.ir import Graph, Node
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.match import Users, const_of, reject, replace, scalar_of


def pad_amounts(pad: Node, rank: int) -> list[int] | None:
    """The Pad's pads for all ``rank`` axes ([begin..., end...]) when it is a constant zero pad,
    else None."""
    a = pad.attrs
    if (a.mode or "constant") != "constant":
        return None
    pads = const_of(pad.inputs[1]) if len(pad.inputs) > 1 and pad.inputs[1] is not None \
        else (None if a.pads is None else np.asarray(a.pads))
    value = pad.inputs[2] if len(pad.inputs) > 2 else None
    if pads is None or (value is not None and scalar_of(value) != 0.0) or (
            len(pad.inputs) <= 1 and (a.value or 0.0) != 0.0):
        return None
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    axes = const_of(pad.inputs[3]) if len(pad.inputs) > 3 and pad.inputs[3] is not None \
        else None
    if axes is not None:  # opset 18: pads for the listed axes only
        full = [0] * (2 * rank)
        axes = [int(x) % rank for x in axes.reshape(-1)]
        for k, ax in enumerate(axes):
            full[ax], full[rank + ax] = pads[k], pads[len(axes) + k]
        pads = full
    return pads if len(pads) == 2 * rank else None


def merged_pads(pad: Node, op: Node) -> list[int] | str:
    """The op's pads with the Pad's spatial pads added, or why they cannot be."""
    x = pad.inputs[0]
    rank = x.type.rank if x is not None and x.type is not None else None
    if rank is None or rank < 3:
        return "the padded tensor's rank is unknown"
    pads = pad_amounts(pad, rank)
    if pads is None:
        return "the Pad is not a constant zero pad with constant pads"
    if any(p < 0 for p in pads):
        return "the Pad crops (negative pads)"
    if pads[0] or pads[1] or pads[rank] or pads[rank + 1]:
        return "the Pad pads the batch or channel axis"
    if (op.attrs.auto_pad or "NOTSET") != "NOTSET":
        return f"{op.op.name} uses auto_pad={op.attrs.auto_pad}"
    s = rank - 2
    own = list(op.attrs.pads) if op.attrs.pads is not None else [0] * (2 * s)
    return [own[i] + pads[2 + i] for i in range(s)] + [own[s + i] + pads[rank + 2 + i]
                                                       for i in range(s)]


def _pool_attrs(pool: Node, pads: list[int]):
    a = pool.attrs
    if a.count_include_pad:
        return dataclasses.replace(a, pads=tuple(pads))
    if a.pads is None or not any(a.pads):  # no pads of its own: count the Pad's zeros
        return dataclasses.replace(a, pads=tuple(pads), count_include_pad=1)
    return None


def fold_pad_conv(graph: Graph, log: Callable[[str], None]) -> int:
    """Pad(x, constant 0) -> Conv | AveragePool  =>  the op with the pads added."""
    users, n = Users(graph), 0
    for pad in list(graph.nodes):
        if pad.op is not T.Pad or pad not in graph.nodes:
            continue
        op = users.only(pad.outputs[0])
        if op is None or op.op not in (N.Conv, N.AveragePool) or op.inputs[0] is not \
                pad.outputs[0]:
            continue
        pads = merged_pads(pad, op)
        attrs = None
        if isinstance(pads, list):
            attrs = dataclasses.replace(op.attrs, pads=tuple(pads)) if op.op is N.Conv \
                else _pool_attrs(op, pads)
            if attrs is None:
                pads = "the AveragePool has pads of its own and does not count padding"
        if isinstance(pads, str):
            reject(log, "pad + " + op.op.name, pad, pads)
            continue
        replace(graph, [pad, op], op.op, [pad.inputs[0], *op.inputs[1:]], attrs, op.outputs[0],
                log)
        users.refresh()
        n += 1
    return n


PASSES = [("fold_pad_conv", fold_pad_conv)]
