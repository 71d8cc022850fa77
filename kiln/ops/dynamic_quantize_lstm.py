"""com.microsoft DynamicQuantizeLSTM (onnxruntime's contrib op, what its ``quantize_dynamic``
makes of an LSTM): the LSTM of ONNX with 8-bit W [dirs, input, 4*hidden] and R
[dirs, hidden, 4*hidden] (transposed against LSTM's), each with a scale and zero point per
direction or per column; X and every step's h are quantized to uint8 on the fly.

Inputs: X, W, R, B, sequence_lens, initial_h, initial_c, P, W_scale, W_zero_point, R_scale,
R_zero_point. Outputs and attributes are LSTM's (no ``layout``: always time-major)."""

from __future__ import annotations

from kiln.ir import REGISTRY
from kiln.ir.opdef import InferCtx, OpDef
from kiln.ops import rnn as R


def _rule(ctx: InferCtx):
    return R.lstm_like_rule(ctx, hidden_dim=1)


DynamicQuantizeLSTM = REGISTRY.add(OpDef(
    "DynamicQuantizeLSTM", dict(R.LSTM.attrs), domain="com.microsoft", infer=_rule,
    versions=(1,), doc="LSTM with 8-bit weights, inputs quantized per step (onnxruntime)"))
