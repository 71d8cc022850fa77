"""Fused ops kiln's optimizer creates for transformer blocks (fused_transformer)."""

from __future__ import annotations

from kiln.ir import REQUIRED, Attr, InferCtx
from kiln.ops.rules import broadcast, tensor
from kiln.ops.schema import kiln_op


def _attention_rule(ctx: InferCtx):
    # softmax(q k^T * scale + mask) v: q's leading dims, v's last dim (packed or per-head)
    split = ctx.attrs.qkv_split
    if split:  # one [B, S, Dq + Dk + Dv] input: the output's last dim is Dv
        qkv = ctx.shape(0)
        shape = None if qkv is None else (*qkv[:-1], split[2])
        return [tensor(ctx.dtype(0), shape)]
    q, v = ctx.shape(0), ctx.shape(2)
    shape = None if q is None or v is None else (*q[:-1], v[-1])
    return [tensor(ctx.dtype(0), shape)]


Attention = kiln_op(
    "Attention",
    {"num_heads": Attr("int", 0), "scale": Attr("float", REQUIRED),
     "causal": Attr("int", 0), "qkv_split": Attr("ints", None)},
    _attention_rule,
    doc="softmax(q @ k^T * scale + mask) @ v. num_heads > 0: q, k, v are [B, S, H*D] and the "
        "result [B, S, H*Dv]; num_heads == 0: q [..., Sq, D], k given transposed [..., D, Sk], "
        "v [..., Sk, Dv]. mask (optional 4th input): additive float, broadcast to "
        "[B, H, Sq, Sk]. causal: top-left aligned causal mask. qkv_split [Dq, Dk, Dv] "
        "(num_heads > 0, CPU builds): input 0 holds q, k and v side by side on its last dim "
        "(the merged projection's output) and inputs 1 and 2 are absent.")


FusedPointwise = kiln_op(
    "FusedPointwise",
    {"program": Attr("string", REQUIRED)},
    broadcast(),
    doc="A chain of elementwise ops run as one node. program: JSON list of steps "
        "[op name, [refs]], a ref 'iN' the node's input N, 'sN' step N's result; the last "
        "step's result is the output.")
