"""Fused ops kiln's optimizer creates for transformer blocks (fused_transformer)."""

from __future__ import annotations

from kiln.ir import REQUIRED, Attr, InferCtx
from kiln.ops.rules import tensor
from kiln.ops.schema import kiln_op


def _attention_rule(ctx: InferCtx):
    # softmax(q k^T * scale + mask) v: q's leading dims, v's last dim (packed or per-head)
    q, v = ctx.shape(0), ctx.shape(2)
    shape = None if q is None or v is None else (*q[:-1], v[-1])
    return [tensor(ctx.dtype(0), shape)]


Attention = kiln_op(
    "Attention",
    {"num_heads": Attr("int", 0), "scale": Attr("float", REQUIRED),
     "causal": Attr("int", 0)},
    _attention_rule,
    doc="softmax(q @ k^T * scale + mask) @ v. num_heads > 0: q, k, v are [B, S, H*D] and the "
        "result [B, S, H*Dv]; num_heads == 0: q [..., Sq, D], k given transposed [..., D, Sk], "
        "v [..., Sk, Dv]. mask (optional 4th input): additive float, broadcast to "
        "[B, H, Sq, Sk]. causal: top-left aligned causal mask.")


def _program_rule(ctx: InferCtx):
    return [tensor(t.dtype, t.shape) for t in ctx.attrs.out_types]


FusedPointwise = kiln_op(
    "FusedPointwise",
    {"program": Attr("string", REQUIRED), "out_types": Attr("tensors", REQUIRED)},
    _program_rule,
    doc="A chain of elementwise ops run as one node; program is its JSON sub-program.")
