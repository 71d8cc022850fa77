"""Fusion (CPU builds): a fused matrix product and the LayerNormalization that alone reads it
(CUDA builds too once its CUDA kernel has had a clean GPU run: see kiln.passes.pipeline).

    FusedMatMul(x, W, b, r)  ──>  LayerNormalization(scale, bias)    BERT's post-norm blocks
                         ==>  FusedMatMulLayerNorm(x, W, b, r, scale, bias)  "mm + ln"

The product's kernel then normalizes its own fresh output in place, in the same step: one step
less per block, and on the CPU the norm runs in kiln's C library right after the GEMM instead of
as a separate PyTorch call; on CUDA a cuBLAS product's residual is added by the norm kernel as
it reads the row, instead of by a pass of its own. Fires only when the product's output feeds
the norm alone (and is no graph output), the norm has one output, normalizes the last axis,
and has a constant 1-D scale (and bias, if any) as long as that axis. Pre-norm blocks (GPT-2),
where the residual sum is read again by the next block's residual add, keep their separate
norm.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Value
from kiln.ir.rewrite import insert_before, remove_nodes, single_user
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N


def _const_vector(v: Value | None, n: int) -> bool:
    return (v is not None and v.const is not None and v.const.ndim == 1
            and v.const.shape[0] == n)


def _match(graph: Graph, mm: Node, users: dict) -> Node | None:
    """The LayerNormalization to merge into ``mm``, or None."""
    if len(mm.inputs) < 2 or mm.inputs[1] is None or mm.inputs[1].const is None:
        return None
    w = mm.inputs[1].const
    out_shape = getattr(mm.outputs[0].type, "shape", None)
    if w.ndim != 2 or out_shape is None or len(out_shape) < 2:
        return None
    ln = single_user(graph, mm.outputs[0], users)
    if ln is None or ln.op is not N.LayerNormalization or ln.inputs[0] is not mm.outputs[0]:
        return None
    if len(ln.outputs) != 1 or ln.outputs[0] is None:  # Mean / InvStdDev are wanted
        return None
    axis = -1 if ln.attrs.axis is None else ln.attrs.axis
    if axis not in (-1, len(out_shape) - 1):
        return None
    scale = ln.inputs[1] if len(ln.inputs) > 1 else None
    bias = ln.inputs[2] if len(ln.inputs) > 2 else None
    if not _const_vector(scale, w.shape[1]) or (bias is not None
                                                 and not _const_vector(bias, w.shape[1])):
        return None
    return ln


def fuse_matmul_layernorm(graph: Graph, log) -> int:
    users, n = graph.users(), 0
    for mm in [x for x in graph.nodes if x.op is FC.FusedMatMul]:
        ln = _match(graph, mm, users)
        if ln is None:
            continue
        ins = list(mm.inputs) + [None] * (4 - len(mm.inputs))
        ins += [ln.inputs[1], ln.inputs[2] if len(ln.inputs) > 2 else None]
        while ins[-1] is None:
            ins.pop()
        eps = 1e-5 if ln.attrs.epsilon is None else ln.attrs.epsilon
        attrs = FC.FusedMatMulLayerNorm.make_attrs(**vars(mm.attrs), epsilon=eps)
        fused = Node(FC.FusedMatMulLayerNorm, f"{mm.name} + {ln.name}", ins, [ln.outputs[0]],
                     attrs)
        insert_before(graph, ln, fused)
        remove_nodes(graph, [mm, ln])
        log(f"fused {mm.name} + {ln.name} -> {FC.FusedMatMulLayerNorm.name}")
        n += 1
    return n


PASSES = [("fuse_matmul_layernorm", fuse_matmul_layernorm)]
