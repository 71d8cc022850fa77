"""RNN, GRU and LSTM nodes as native program records: the node's bound kernel call
(:class:`kiln.native.rnn.RecurrentCall`, made and cached on the node by the traced run) becomes
a record that ``kiln_rnn_record`` (``rnn.c``) runs with the program's buffers, preceded by a GEMM
record for the input projection of every step (as :meth:`RecurrentCall.__call__`
does for sequences longer than :data:`~kiln.native.rnn.DIRECT_ROWS`; see :data:`DIRECT_ROWS`).

A node whose traced run took the PyTorch step loop (an activation rnn.c lacks) has no bound
call and stays a torch record; so does one whose ``sequence_lens`` is computed.
"""

from __future__ import annotations

import torch

from kiln.engine.program import Val, is_contiguous
from kiln.engine.program_ops import OP_GEMM, emit_copy
from kiln.native import rnn as native_rnn
from kiln.ops import rnn as R

OP_RNN = 8
# In a program the input projection is a GEMM record before the recurrence at every length:
# the call cost that keeps the kernel's own short sequences (native_rnn.DIRECT_ROWS) projecting
# inside the recurrence, step by step, is not there, and one GEMM over every step's rows reads
# the weight once (torch_gru_stream_op17, 2 layers x 8 steps of a 96-wide GRU, one process,
# 7 alternating rounds: 43.7 -> 35.0 us a run; silero-vad's one-row LSTM level, 42.2 -> 41.8)
DIRECT_ROWS = 0
_BUFS = ("xw", "x", "h0", "c0", "y", "yh", "yc")  # rnn.c's kiln_rnn_record order


def _contiguous(pc, v: Val) -> Val:
    if is_contiguous(v):
        return v
    y = pc.alloc(v.shape)
    emit_copy(pc, v, y)
    return y


def _recurrent(pc, st, ins, outs):
    run = st.call.cache.get("rnn_run")
    src = st.call.cache.get("rnn_src")
    x = ins[0]
    if run is None or src is None or x is None or len(x.shape) != 3 or min(x.shape) < 1 \
            or any(m is None for m in outs):
        return None
    if any(k < len(st.ins) and st.ins[k] >= 0 and pc.consts.get(st.ins[k]) is not c
           for k, c in zip((1, 2, 3, 7), src)):
        return None  # the bound call packed other weights than this step's constants
    pw = run.pw
    b0, b1, i = x.shape
    t, b = (b1, b0) if run.layout else (b0, b1)
    if i != pw.i:
        return None
    dirs, h, n = pw.dirs, pw.h, pw.n
    st_shape = (b, dirs, h) if run.layout else (dirs, b, h)
    states = {}
    for name, k in (("h0", 5), ("c0", 6)):
        if k < len(st.ins) and st.ins[k] >= 0:
            v = ins[k]
            if v is None or tuple(v.shape) != st_shape:
                return None
            states[name] = _contiguous(pc, v)
    p = list(run.p)
    p[native_rnn.P["t"]], p[native_rnn.P["b"]] = t, b
    if len(st.ins) > 4 and st.ins[4] >= 0:
        lens = pc.consts.get(st.ins[4])
        if lens is None or lens.numel() != b:
            return None
        lens = lens.reshape(-1).to(torch.int64).contiguous()
        pc.keep.append(lens)
        p[native_rnn.P["lens"]] = lens.data_ptr()
    x = _contiguous(pc, x)
    m, row = b0 * b1, dirs * n
    bufs: dict = {"x": None, "xw": None}
    if m <= DIRECT_ROWS:
        bufs["x"] = x
        p[native_rnn.P["xt"]], p[native_rnn.P["xb"]] = (i, t * i) if run.layout else (b * i, i)
    else:
        xw = pc.alloc((m, row))
        rec = [OP_GEMM, m, row, i]
        pc.put(rec, x)
        rec += [i, pc.fixed(pw.packed.data), pc.fixed(pw.bias)]
        pc.put(rec, None)
        rec.append(0)
        pc.put(rec, xw)
        rec += [row, 0, pc.fparam(float("-inf"), float("inf"))]
        pc.emit(rec)
        bufs["xw"] = xw
        p[native_rnn.P["xwt"]], p[native_rnn.P["xwb"]] = (
            (row, t * row) if run.layout else (b * row, row))
    y_shape = (b, t, dirs, h) if run.layout else (t, dirs, b, h)
    made = [pc.alloc(y_shape), pc.alloc(st_shape)]
    if pw.kind == "LSTM":
        made.append(pc.alloc(st_shape))
    if len(outs) > len(made) or any(tuple(m.shape) != v.shape for m, v in zip(outs, made)):
        return None
    p[native_rnn.P["yt"]], p[native_rnn.P["yb"]], p[native_rnn.P["ydir"]] = (
        (dirs * h, t * dirs * h, h) if run.layout else (dirs * b * h, h, b * h))
    p[native_rnn.P["state_row"]], p[native_rnn.P["state_dir"]] = (
        (dirs * h, h) if run.layout else (h, b * h))
    bufs.update(states, y=made[0], yh=made[1], yc=made[2] if len(made) > 2 else None)
    for name in _BUFS:  # rnn.c fills these from the record's buffers
        p[native_rnn.P[name]] = 0
    rec = [OP_RNN, pc.fparam(*run.f), *p]
    for name in _BUFS:
        pc.put(rec, bufs.get(name))
    pc.keep.append(run)
    pc.emit(rec)
    return made[:len(outs)]


assert len(native_rnn.P) == 37  # rnn.c's P_COUNT (RNN_FIELDS in kernels.h)
PLANNERS = {R.RNN: _recurrent, R.GRU: _recurrent, R.LSTM: _recurrent}
