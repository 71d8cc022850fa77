"""Fusion (CUDA builds): an activation of a reshaped product moves before the Reshape, where the
product's fused epilogue can take it.

    Gemm ─▶ Reshape(s) ─▶ Gelu ─▶ y       ==>     Gemm ─▶ Gelu ─▶ Reshape(s) ─▶ y

Hugging Face's ``Conv1D`` layers (GPT-2's MLP and attention projections) compute
``addmm(b, x.view(-1, nx), W).view(*lead, nf)``, which torch.onnx writes as Reshape -> Gemm ->
Reshape: the activation reads the reshaped product, so ``fuse_conv_bias_act`` (which needs the
activation to read the product itself) left GPT-2's tanh GELU as a separate pass over the MLP's
widest tensor. An elementwise activation commutes with a Reshape (same elements, same order), so
it moves to read the product; the Reshape then reads the activation's result and gives ``y`` as
before (and merges with the next layer's Reshape back to 2-D). Fires where the product
(Gemm, MatMul, FusedGemm or FusedMatMul without an activation) feeds the Reshape alone, the
Reshape feeds the activation alone, the activation is one the fused ops take
(``conv_bias_act.pm_activation``) with constant extra inputs, and neither intermediate value is
a graph output. CPU builds keep the graph as it is.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.rewrite import is_graph_output
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.conv_bias_act import pm_activation

PRODUCTS = (N.Gemm, N.MatMul, FC.FusedGemm, FC.FusedMatMul)


def _only_reader(graph: Graph, v: Value, users: dict, node: Node) -> bool:
    return users.get(id(v)) == [node] and not is_graph_output(graph, v)


def _movable(graph: Graph, act: Node, users: dict) -> Node | None:
    """The Reshape ``act`` can move before, or None."""
    if act.op not in pm_activation or pm_activation[act.op](act) is None:
        return None
    if any(v is not None and v.const is None for v in act.inputs[1:]):
        return None
    rs = act.inputs[0].producer if act.inputs[0] is not None else None
    if rs is None or rs.op is not T.Reshape or not _only_reader(graph, rs.outputs[0], users, act):
        return None
    x = rs.inputs[0]
    p = x.producer
    if p is None or p.op not in PRODUCTS or not _only_reader(graph, x, users, rs):
        return None
    if p.op in (FC.FusedGemm, FC.FusedMatMul) and p.attrs.activation:
        return None
    return rs


def sink_activation_through_reshape(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for act in [x for x in graph.nodes if x.op in pm_activation]:
        rs = _movable(graph, act, users)
        if rs is None:
            continue
        x, y = rs.inputs[0], act.outputs[0]
        dtype = getattr(y.type, "dtype", None) or getattr(x.type, "dtype", None)
        mid = Value(graph.fresh_name(f"{x.name}_{act.op.name.lower()}"),
                    TensorType(dtype, getattr(x.type, "shape", None)))
        act.inputs[0], act.outputs = x, [mid]
        mid.producer = act
        rs.inputs[0], rs.outputs = mid, [y]
        y.producer = rs
        graph.nodes.remove(act)  # the activation now runs first: just before the Reshape
        graph.nodes.insert(graph.nodes.index(rs), act)
        log(f"moved {act.op.name} '{act.name}' before Reshape '{rs.name}' (onto "
            f"{x.producer.op.name} '{x.producer.name}')")
        users = graph.users()
        n += 1
    return n


PASSES = [("sink_activation_through_reshape", sink_activation_through_reshape)]
