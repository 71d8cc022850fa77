"""PyTorch kernels: control flow (If, Loop, Scan), sequences and optionals.

Sequences are Python lists of tensors, an empty optional is None. Subgraphs run through
``n.run_graph``; values captured from the enclosing graph follow the declared inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.ir import TensorType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.kernels.torch.util import ints
from kiln.ops import control as C


def _scalar(x) -> int:
    return int(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else int(np.asarray(x).ravel()[0])


def _stack(values: list, axis: int, empty_type) -> torch.Tensor | np.ndarray:
    """Per-iteration scan values stacked along ``axis``; zero iterations give an empty tensor
    shaped after the declared output type."""
    if not values:
        return _empty(empty_type)
    if isinstance(values[0], np.ndarray):
        return np.stack(values, axis=axis)
    return torch.stack(values, dim=axis)


def _empty(t) -> torch.Tensor | np.ndarray:
    dims = [0]
    if isinstance(t, TensorType) and t.shape is not None and len(t.shape) > 1:
        dims = [0] + [d if isinstance(d, int) else 0 for d in t.shape[1:]]
    dtype = t.dtype if isinstance(t, TensorType) else None
    if dtype is not None and dtype not in TORCH_DTYPE:
        return np.zeros(dims, dtype=dtype.np)
    return torch.zeros(dims, dtype=TORCH_DTYPE[dtype] if dtype is not None else torch.float32)


@register(C.If)
def if_(n, cond, *captured):
    branch = n.a.then_branch if bool(cond.reshape(-1)[0]) else n.a.else_branch
    return tuple(n.run_graph(branch, [], captured))


@register(C.Loop)
def loop(n, max_trip, cond, *rest):
    """Loop: runs while ``i < M`` (if M is given) and the condition holds (if cond is given);
    without a cond input the body's cond output is ignored."""
    carried, captured = list(rest[:n.n_in - 2]), rest[n.n_in - 2:]
    trips = _scalar(max_trip) if max_trip is not None else None
    keep = bool(cond.reshape(-1)[0]) if cond is not None else True
    scans: list[list] = [[] for _ in range(n.n_out - len(carried))]
    i = 0
    while keep and (trips is None or i < trips):
        args = [torch.tensor(i, dtype=torch.int64), torch.tensor(keep)] + carried
        outs = n.run_graph(n.a.body, args, captured)
        if cond is not None:
            keep = bool(outs[0].reshape(-1)[0])
        carried = list(outs[1:1 + len(carried)])
        for acc, v in zip(scans, outs[1 + len(carried):]):
            acc.append(v)
        i += 1
        if trips is None and cond is None:
            raise KilnError(f"Loop '{n.node_name}' has neither a trip count nor a condition")
    stacked = [_stack(acc, 0, t) for acc, t in zip(scans, n.out_types[len(carried):])]
    return tuple(carried + stacked)


def _take(x, axis: int, t: int):
    if isinstance(x, np.ndarray):
        return np.take(x, t, axis=axis)
    return x.select(axis, t)


def _run_scan(n, states: list, xs: list, in_axes, in_dirs, captured, steps: int):
    """One scan over ``steps`` iterations: returns final states and per-step output lists."""
    body = n.a.body
    n_state = len(states)
    outs_per_step: list[list] = [[] for _ in range(len(body.outputs) - n_state)]
    for t in range(steps):
        slices = [_take(x, ax, steps - 1 - t if d else t) for x, ax, d in zip(xs, in_axes, in_dirs)]
        outs = n.run_graph(body, states + slices, captured)
        states = list(outs[:n_state])
        for acc, v in zip(outs_per_step, outs[n_state:]):
            acc.append(v)
    return states, outs_per_step


@register(C.Scan)
def scan(n, *inputs):
    body = n.a.body
    n_body = len(body.inputs)
    scan8 = n.opset < 9 if n.opset else n.n_in == n_body + 1
    if scan8:  # Scan-8: sequence_lens first, batch axis 0 on everything
        return _scan8(n, inputs[0], list(inputs[1:n.n_in]), inputs[n.n_in:])
    captured = inputs[n.n_in:]
    n_scan = n.a.num_scan_inputs
    n_state = n_body - n_scan
    states, xs = list(inputs[:n_state]), list(inputs[n_state:n.n_in])
    in_axes = [a + x.ndim if a < 0 else a for a, x in
               zip(n.a.scan_input_axes or (0,) * n_scan, xs)]
    in_dirs = n.a.scan_input_directions or (0,) * n_scan
    steps = xs[0].shape[in_axes[0]]
    states, per_step = _run_scan(n, states, xs, in_axes, in_dirs, captured, steps)
    n_extra = len(per_step)
    out_axes = n.a.scan_output_axes or (0,) * n_extra
    out_dirs = n.a.scan_output_directions or (0,) * n_extra
    ys = []
    for acc, ax, d, t in zip(per_step, out_axes, out_dirs, n.out_types[n_state:]):
        if d:
            acc = acc[::-1]
        rank = acc[0].ndim + 1 if acc else 1
        ys.append(_stack(acc, ax + rank if ax < 0 else ax, t))
    return tuple(states + ys)


def _scan8(n, seq_lens, rest: list, captured):
    n_scan = n.a.num_scan_inputs
    n_state = len(rest) - n_scan
    states, xs = rest[:n_state], rest[n_state:]
    dirs = n.a.directions or (0,) * n_scan
    batch = xs[0].shape[0] if xs else states[0].shape[0]
    max_len = xs[0].shape[1]
    lens = ints(seq_lens) if seq_lens is not None else [max_len] * batch
    out_states: list[list] = [[] for _ in range(n_state)]
    out_scans: list[list] = []
    for b in range(batch):
        st, per_step = _run_scan(n, [s[b] for s in states], [x[b] for x in xs],
                                 [0] * n_scan, dirs, captured, lens[b])
        for acc, s in zip(out_states, st):
            acc.append(s)
        stacked = [_pad_steps(torch.stack(acc), max_len) for acc in per_step]
        out_scans.append(stacked)
    ys = [torch.stack([row[j] for row in out_scans]) for j in range(len(out_scans[0]))]
    return tuple([torch.stack(acc) for acc in out_states] + ys)


def _pad_steps(y: torch.Tensor, length: int) -> torch.Tensor:
    """Scan-8 pads the outputs of shorter sequences with zeros up to the longest."""
    if y.shape[0] == length:
        return y
    pad = torch.zeros((length - y.shape[0], *y.shape[1:]), dtype=y.dtype)
    return torch.cat([y, pad])


# -- sequences ------------------------------------------------------------------------------

@register(C.SequenceConstruct)
def sequence_construct(n, *xs):
    return list(xs[:n.n_in])


@register(C.SequenceEmpty)
def sequence_empty(n):
    return []


def _position(pos, length: int, insert: bool = False) -> int:
    p = _scalar(pos)
    limit = length + 1 if insert else length
    if p < 0:
        p += length
    if not 0 <= p < limit:
        raise IndexError(f"sequence position {_scalar(pos)} out of range for length {length}")
    return p


@register(C.SequenceAt)
def sequence_at(n, seq, pos):
    return seq[_position(pos, len(seq))]


@register(C.SequenceInsert)
def sequence_insert(n, seq, x, pos=None):
    out = list(seq)
    out.insert(len(out) if pos is None else _position(pos, len(out), insert=True), x)
    return out


@register(C.SequenceErase)
def sequence_erase(n, seq, pos=None):
    out = list(seq)
    del out[len(out) - 1 if pos is None else _position(pos, len(out))]
    return out


@register(C.SequenceLength)
def sequence_length(n, seq):
    return torch.tensor(len(seq), dtype=torch.int64)


@register(C.SplitToSequence)
def split_to_sequence(n, x, split=None):
    axis = n.a.axis + x.ndim if n.a.axis < 0 else n.a.axis
    if split is None:
        parts = list(torch.split(x, 1, dim=axis))
        return [p.squeeze(axis) for p in parts] if not n.a.keepdims else parts
    if split.ndim == 0:
        return list(torch.split(x, _scalar(split), dim=axis))
    return list(torch.split(x, ints(split), dim=axis))


@register(C.ConcatFromSequence)
def concat_from_sequence(n, seq):
    if not seq:
        raise ValueError("ConcatFromSequence of an empty sequence")
    rank = seq[0].ndim + (1 if n.a.new_axis else 0)
    axis = n.a.axis + rank if n.a.axis < 0 else n.a.axis
    if isinstance(seq[0], np.ndarray):
        return np.stack(seq, axis) if n.a.new_axis else np.concatenate(seq, axis)
    return torch.stack(seq, dim=axis) if n.a.new_axis else torch.cat(seq, dim=axis)


@register(C.SequenceMap)
def sequence_map(n, seq, *rest):
    """Runs the body once per element of the first sequence; sequence inputs are indexed in
    step, tensor inputs are passed whole."""
    extra, captured = rest[:n.n_in - 1], rest[n.n_in - 1:]
    outs: list[list] = [[] for _ in range(n.n_out)]
    for i in range(len(seq)):
        args = [seq[i]] + [a[i] if isinstance(a, list) else a for a in extra]
        for acc, v in zip(outs, n.run_graph(n.a.body, args, captured)):
            acc.append(v)
    return tuple(outs)


# -- optionals ------------------------------------------------------------------------------

@register(C.Optional)
def optional(n, x=None):
    return x


@register(C.OptionalHasElement)
def optional_has_element(n, x=None):
    return torch.tensor(x is not None)


@register(C.OptionalGetElement)
def optional_get_element(n, x=None):
    if x is None:
        raise KilnError(f"OptionalGetElement '{n.node_name}': the optional is empty")
    return x
