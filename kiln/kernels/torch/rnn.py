"""PyTorch kernels: RNN, GRU, LSTM (ONNX semantics: gate orders, activations attrs, clip,
layout, sequence_lens, initial states, peepholes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.registry import register
from kiln.native import rnn as native_rnn
from kiln.ops import rnn as R

# name -> (fn(x, alpha, beta), default alpha, default beta); alpha/beta are None when unused
_ACT = {
    "relu": (lambda x, a, b: torch.relu(x), None, None),
    "tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: F.leaky_relu(x, a), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: (a * x + b).clamp(0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: F.elu(x, a), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + x.abs()), None, None),
    "softplus": (lambda x, a, b: F.softplus(x), None, None),
}
_DEFAULT_ACTS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}


def _activations(a, kind: str, dirs: int) -> list[list]:
    """Per direction, the list of activation callables. alpha/beta values are consumed in
    order by the functions that take them (as onnxruntime does)."""
    names = list(a.activations or ())
    per = len(_DEFAULT_ACTS[kind])
    if not names:
        names = list(_DEFAULT_ACTS[kind]) * dirs
    elif len(names) == per and dirs == 2:
        names = names * 2
    alphas, betas = list(a.activation_alpha or ()), list(a.activation_beta or ())
    fns = []
    for name in names:
        key = name.lower()
        if key not in _ACT:
            raise ValueError(f"{kind}: unsupported activation {name!r}")
        fn, da, db = _ACT[key]
        al = (alphas.pop(0) if alphas else da) if da is not None else None
        be = (betas.pop(0) if betas else db) if db is not None else None
        fns.append(lambda x, fn=fn, al=al, be=be: fn(x, al, be))
    return [fns[d * per:(d + 1) * per] for d in range(dirs)]


def _native(n, kind: str, x, w, r, b, p, seq_lens, h0, c0):
    """The node on kiln's C recurrence (kiln.native.rnn), its weights packed once per node;
    None where that kernel does not take it (another dtype or device, an activation it lacks,
    an empty sequence, no C library)."""
    if not native_rnn.fits(x, w, r, b, p, seq_lens, h0, c0) or w.dtype != torch.float32:
        return None
    src = n.cache.get("rnn_src")
    if src is None or any(a is not c for a, c in zip(src, (w, r, b, p))):
        dirs = w.shape[0]
        acts = native_rnn.activation_codes(n.a, kind, dirs)
        run = None if acts is None else native_rnn.RecurrentCall(
            native_rnn.RecurrentWeights(kind, w, r, b, p), n.a, acts,
            reverse=n.a.direction == "reverse")
        n.cache["rnn_src"], n.cache["rnn_run"] = (w, r, b, p), run
    run = n.cache["rnn_run"]
    if run is None:
        return None
    y, yh, yc = run(x, seq_lens, h0, c0)
    outs = (y, yh) if yc is None else (y, yh, yc)
    return outs[:max(n.n_out, 1)] if n.n_out > 1 else outs[0]


def _prepare(n, kind: str, x, w, r, b, seq_lens, h0, c0=None):
    """Common setup: time-major input, per-direction weights, biases and initial states."""
    a = n.a
    if a.layout:
        x = x.transpose(0, 1)
        h0 = None if h0 is None else h0.transpose(0, 1)
        c0 = None if c0 is None else c0.transpose(0, 1)
    seq, batch = x.shape[0], x.shape[1]
    dirs, gh = w.shape[0], w.shape[1]
    hidden = r.shape[-1]
    if b is None:
        b = x.new_zeros((dirs, 2 * gh))
    if h0 is None:
        h0 = x.new_zeros((dirs, batch, hidden))
    if c0 is None and kind == "LSTM":
        c0 = x.new_zeros((dirs, batch, hidden))
    if seq_lens is None:
        mask = None
    else:  # (seq, batch, 1): which steps are real for each batch entry
        mask = (torch.arange(seq)[:, None] < seq_lens.reshape(1, -1).long())[..., None]
    return x, b, h0, c0, mask, seq, dirs


def _clip(v, clip):
    return v if clip is None else v.clamp(-clip, clip)


def _steps(seq: int, reverse: bool):
    return range(seq - 1, -1, -1) if reverse else range(seq)


def _finish(n, ys, hs, cs=None):
    """Stack per-direction results into ONNX's output layouts."""
    y = torch.stack(ys, 1)  # (seq, dirs, batch, hidden)
    yh = torch.stack(hs, 0)  # (dirs, batch, hidden)
    yc = torch.stack(cs, 0) if cs is not None else None
    if n.a.layout:
        y = y.permute(2, 0, 1, 3)
        yh = yh.transpose(0, 1)
        yc = yc.transpose(0, 1) if yc is not None else None
    outs = (y, yh) if yc is None else (y, yh, yc)
    return outs[:max(n.n_out, 1)] if n.n_out > 1 else outs[0]


def _directions(a, dirs: int) -> list[bool]:
    if dirs == 2:
        return [False, True]
    return [a.direction == "reverse"]


def _masked(mask, t, new, old):
    return new if mask is None else torch.where(mask[t], new, old)


def _out(mask, t, h):
    return h if mask is None else h * mask[t].to(h.dtype)


@register(R.RNN)
def rnn(n, x, w, r, b=None, seq_lens=None, h0=None):
    out = _native(n, "RNN", x, w, r, b, None, seq_lens, h0, None)
    return out if out is not None else rnn_steps(n, x, w, r, b, seq_lens, h0)


def rnn_steps(n, x, w, r, b=None, seq_lens=None, h0=None):
    """RNN step by step in PyTorch (any activation, dtype or device)."""
    x, b, h0, _, mask, seq, dirs = _prepare(n, "RNN", x, w, r, b, seq_lens, h0)
    acts = _activations(n.a, "RNN", dirs)
    ys, hs = [], []
    for d, rev in enumerate(_directions(n.a, dirs)):
        xw = x @ w[d].T + (b[d, :w.shape[1]] + b[d, w.shape[1]:])
        f, h = acts[d][0], h0[d]
        y = [None] * seq
        for t in _steps(seq, rev):
            hn = f(_clip(xw[t] + h @ r[d].T, n.a.clip))
            h = _masked(mask, t, hn, h)
            y[t] = _out(mask, t, h)
        ys.append(torch.stack(y) if seq else x.new_zeros((0,) + h.shape))
        hs.append(h)
    return _finish(n, ys, hs)


@register(R.GRU)
def gru(n, x, w, r, b=None, seq_lens=None, h0=None):
    out = _native(n, "GRU", x, w, r, b, None, seq_lens, h0, None)
    return out if out is not None else gru_steps(n, x, w, r, b, seq_lens, h0)


def gru_steps(n, x, w, r, b=None, seq_lens=None, h0=None):
    """GRU step by step in PyTorch (any activation, dtype or device)."""
    x, b, h0, _, mask, seq, dirs = _prepare(n, "GRU", x, w, r, b, seq_lens, h0)
    acts = _activations(n.a, "GRU", dirs)
    hid = r.shape[-1]
    ys, hs = [], []
    for d, rev in enumerate(_directions(n.a, dirs)):
        wb, rb = b[d, :3 * hid], b[d, 3 * hid:]
        xw = x @ w[d].T + wb  # gates z, r, h
        f, g, h = acts[d][0], acts[d][1], h0[d]
        rz, rh = r[d][:2 * hid], r[d][2 * hid:]
        y = [None] * seq
        for t in _steps(seq, rev):
            zr = f(_clip(xw[t, :, :2 * hid] + h @ rz.T + rb[:2 * hid], n.a.clip))
            z, rt = zr[:, :hid], zr[:, hid:]
            if n.a.linear_before_reset:
                pre = xw[t, :, 2 * hid:] + rt * (h @ rh.T + rb[2 * hid:])
            else:
                pre = xw[t, :, 2 * hid:] + (rt * h) @ rh.T + rb[2 * hid:]
            hn = (1 - z) * g(_clip(pre, n.a.clip)) + z * h
            h = _masked(mask, t, hn, h)
            y[t] = _out(mask, t, h)
        ys.append(torch.stack(y) if seq else x.new_zeros((0,) + h.shape))
        hs.append(h)
    return _finish(n, ys, hs)


@register(R.LSTM)
def lstm(n, x, w, r, b=None, seq_lens=None, h0=None, c0=None, p=None):
    out = _native(n, "LSTM", x, w, r, b, p, seq_lens, h0, c0)
    return out if out is not None else lstm_steps(n, x, w, r, b, seq_lens, h0, c0, p)


def lstm_steps(n, x, w, r, b=None, seq_lens=None, h0=None, c0=None, p=None):
    """LSTM step by step in PyTorch (any activation, dtype or device)."""
    x, b, h0, c0, mask, seq, dirs = _prepare(n, "LSTM", x, w, r, b, seq_lens, h0, c0)
    acts = _activations(n.a, "LSTM", dirs)
    hid = r.shape[-1]
    if p is None:
        p = x.new_zeros((dirs, 3 * hid))
    ys, hs, cs = [], [], []
    for d, rev in enumerate(_directions(n.a, dirs)):
        xw = x @ w[d].T + (b[d, :4 * hid] + b[d, 4 * hid:])  # gates i, o, f, c
        f, g, hf = acts[d]
        pi, po, pf = p[d, :hid], p[d, hid:2 * hid], p[d, 2 * hid:]
        h, c = h0[d], c0[d]
        y = [None] * seq
        for t in _steps(seq, rev):
            gi, go, gf, gc = (xw[t] + h @ r[d].T).split(hid, -1)
            it = f(_clip(gi + pi * c, n.a.clip))
            ft = 1 - it if n.a.input_forget else f(_clip(gf + pf * c, n.a.clip))
            cn = ft * c + it * g(_clip(gc, n.a.clip))
            ot = f(_clip(go + po * cn, n.a.clip))
            hn = ot * hf(cn)
            h, c = _masked(mask, t, hn, h), _masked(mask, t, cn, c)
            y[t] = _out(mask, t, h)
        ys.append(torch.stack(y) if seq else x.new_zeros((0,) + h.shape))
        hs.append(h)
        cs.append(c)
    return _finish(n, ys, hs, cs)
