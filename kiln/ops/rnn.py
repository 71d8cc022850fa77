"""Recurrent nets: RNN, GRU, LSTM."""

from __future__ import annotations

from kiln.ir.opdef import InferCtx
from kiln.ops.rules import tensor
from kiln.ops.schema import onnx_op


def _rnn_rule(ctx: InferCtx):
    """Y: [seq, dirs, batch, hidden] (layout 0) or [batch, seq, dirs, hidden] (layout 1);
    Y_h (and LSTM's Y_c): [dirs, batch, hidden] or [batch, dirs, hidden]."""
    return lstm_like_rule(ctx, hidden_dim=2)


def lstm_like_rule(ctx: InferCtx, hidden_dim: int):
    """The output types of a recurrent node whose R input holds the hidden size in dim
    ``hidden_dim`` (when the hidden_size attribute does not give it)."""
    a = ctx.attrs
    xs, ws, rs = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    dirs = 2 if a.direction == "bidirectional" else 1
    if ws is not None and len(ws) == 3 and isinstance(ws[0], int):
        dirs = ws[0]
    hidden = a.hidden_size
    if hidden is None and rs is not None and len(rs) == 3:
        hidden = rs[hidden_dim]
    if xs is None or len(xs) != 3:
        seq = batch = None
    elif a.layout:
        batch, seq = xs[0], xs[1]
    else:
        seq, batch = xs[0], xs[1]
    dt = ctx.dtype(0)
    if a.layout:
        y, yh = (batch, seq, dirs, hidden), (batch, dirs, hidden)
    else:
        y, yh = (seq, dirs, batch, hidden), (dirs, batch, hidden)
    return [tensor(dt, y), tensor(dt, yh), tensor(dt, yh)][:max(ctx.n_out, 1)]


RNN = onnx_op("RNN", _rnn_rule)
GRU = onnx_op("GRU", _rnn_rule)
LSTM = onnx_op("LSTM", _rnn_rule)
