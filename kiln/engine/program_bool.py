"""Bool values and integer inputs in native programs: the Casts, Wheres and Gathers around
them.

The attention masks that Hugging Face exports build run on integer and bool tensors: the
``attention_mask`` input (int64) is Cast to bool, viewed (Flatten, Gather, Reshape), combined
with a causal pattern (And), and turned into the float mask by ``Where(mask, 0, min)``. Each of
those steps was a torch record (~9 us of Python each, six of them in a decode step of a small
Llama that takes 0.3 ms). Here a program keeps a bool value as float32 0.0/1.0, which every
float record reads and writes exactly, so:

- ``Cast`` of an integer or bool graph input (int64, int32, bool) is one record that reads the
  input in its own dtype (``OP_ICAST``, chain.c): to float32 the value, rounded as C and numpy
  round; to bool ``x != 0``. Cast of a float value to bool is ``NonZero`` (NaN is true, as
  numpy casts it); Cast of a bool value to float32, and to bool, is the value itself;
- ``And`` is ``Mul``, ``Or`` ``Max``, ``Xor`` ``NotEqual``, ``Not`` ``Select(x, 0, 1)``;
- views, gathers and concatenations of bool values are the float planners' (they move values,
  whatever they are);
- ``Where(cond, x, y)`` with a bool ``cond`` and at least one of ``x``, ``y`` a constant scalar
  is one ``Select`` record (both scalars: a unary one); two tensors stay a torch record;
- ``Gather`` of a float32 value by an integer graph input (token ids into an embedding table)
  is one record reading the indices at run time (``OP_GATHER``); an index out of range stops
  the run with an error naming the node, the input and the axis size;
- a bool value that a torch record or a graph output takes is turned back into a bool tensor
  (``x != 0``) there; small bool constants the plan folded become float 0/1 constants where a
  record reads them.

Only those ops take a bool value as a record; any other op given one (none in valid ONNX)
leaves its step to torch.
"""

from __future__ import annotations

import math

import torch

from kiln import native
from kiln.engine.program import OP_GATHER, Val, contiguous_strides, is_contiguous
from kiln.engine.program_ops import RANK, _const_scalar, _dense_like, _pad, emit_pw
from kiln.ops import math as M
from kiln.ops import quant as Q
from kiln.ops import tensor as T

OP_ICAST = 14  # chain.c's record kinds (and OP_GATHER, from kiln.engine.program)
# integer and bool input dtypes a Cast record reads, and chain.c's code for each
INT_SOURCES = {torch.int64: 0, torch.int32: 1, torch.bool: 2}
_F32 = torch.float32
_TO_F32, _TO_BOOL = 1, 9  # ONNX TensorProto codes of Cast's ``to``

# ops whose float planners move values without arithmetic: they take bool values as they are
_VIEWS = {T.Reshape, T.Flatten, T.Squeeze, T.Unsqueeze, T.Identity, T.Transpose, T.Slice,
          T.Split, T.Gather, T.Concat, T.Expand}


def _cast(pc, st, ins, outs):
    to = getattr(st.node.attrs, "to", None)
    if len(outs) != 1 or len(st.ins) != 1 or to not in (_TO_F32, _TO_BOOL):
        return None
    out = outs[0]
    iv = pc.ivals.get(st.ins[0])
    if iv is not None:  # an integer or bool graph input
        x, dtype = iv
        if tuple(x.shape) != tuple(out.shape) or len(x.shape) > RANK:
            return None
        y = pc.alloc(out.shape)
        rec = [OP_ICAST, INT_SOURCES[dtype], int(to == _TO_BOOL or dtype == torch.bool),
               len(x.shape), *_pad(x.shape)]
        pc.put(rec, y)
        rec += _pad(y.strides)
        pc.put(rec, x)
        rec += _pad(x.strides)
        pc.emit(rec)
        return [y]
    x = ins[0]
    if x is None or tuple(x.shape) != tuple(out.shape):
        return None
    if st.ins[0] in pc.boolf or to == _TO_F32:
        return [x]  # bool as float 0/1 is the float32 (and the bool) value; float to float
    y = pc.alloc(out.shape, _dense_like(out.shape, x))
    return [y] if emit_pw(pc, native.POINTWISE["NonZero"], y, x) else None


def _binary(name: str):
    code = native.POINTWISE[name]

    def plan(pc, st, ins, outs):
        if len(outs) != 1 or len(ins) != 2 or any(
                v is None or i not in pc.boolf for v, i in zip(ins, st.ins)):
            return None
        shape = outs[0].shape
        y = pc.alloc(shape, _dense_like(shape, *ins))
        return [y] if emit_pw(pc, code, y, ins[0], ins[1]) else None
    return plan


def _not(pc, st, ins, outs):
    if len(outs) != 1 or ins[0] is None or st.ins[0] not in pc.boolf:
        return None
    shape = outs[0].shape
    y = pc.alloc(shape, _dense_like(shape, ins[0]))
    return [y] if emit_pw(pc, native.POINTWISE["Select"], y, ins[0], None, 0.0, 1.0) else None


def _where(pc, st, ins, outs):
    """Where of a bool value and a constant scalar on at least one side: one Select record."""
    if len(outs) != 1 or len(ins) != 3 or ins[0] is None or st.ins[0] not in pc.boolf:
        return None
    c = ins[0]
    sx, sy = _const_scalar(pc, st, 1), _const_scalar(pc, st, 2)
    sx = sx if isinstance(sx, float) else None
    sy = sy if isinstance(sy, float) else None
    shape = tuple(outs[0].shape)
    y = pc.alloc(shape, _dense_like(shape, c, *(v for v in ins[1:] if v is not None)))
    if sx is not None and sy is not None:
        ok = emit_pw(pc, native.POINTWISE["Select"], y, c, None, sx, sy)
    elif sy is not None and ins[1] is not None:
        ok = emit_pw(pc, native.POINTWISE["SelectB"], y, c, ins[1], sy)
    elif sx is not None and ins[2] is not None:
        ok = emit_pw(pc, native.POINTWISE["SelectA"], y, c, ins[2], sx)
    else:
        return None
    return [y] if ok else None


def _gather(pc, st, ins, outs):
    """Gather of a contiguous float32 value by an integer graph input (token ids into the
    embedding table): one record that reads the indices at run time; an index out of range
    stops the run with the node named (see ``Program._run``)."""
    x, iv = ins[0], pc.ivals.get(st.ins[1]) if len(st.ins) > 1 else None
    if x is None or iv is None or len(outs) != 1 or iv[1] == torch.bool or not x.shape:
        return None
    idx, _ = iv
    if not is_contiguous(idx) or not is_contiguous(x):
        return None
    ax = (st.node.attrs.axis or 0) % len(x.shape)
    n, size = math.prod(idx.shape), x.shape[ax]
    inner, outer = math.prod(x.shape[ax + 1:]), math.prod(x.shape[:ax])
    y = pc.alloc(outs[0].shape)
    if math.prod(y.shape) != outer * n * inner:
        return None
    rec = [OP_GATHER, INT_SOURCES[iv[1]], n, size, inner, outer]
    pc.put(rec, x)
    pc.put(rec, idx)
    pc.put(rec, y)
    pc.emit(rec)
    return [y]


PLANNERS = {Q.Cast: _cast, T.Gather: _gather, M.And: _binary("Mul"), M.Or: _binary("Max"),
            M.Xor: _binary("NotEqual"), M.Not: _not, M.Where: _where}
# ops that may read a bool value: this module's and the views'
_TAKE_BOOL = set(PLANNERS) | _VIEWS


def plan(pc, st, ins, outs, planner):
    """This module's planner for the step, then (where it declines) the op's float one."""
    own = PLANNERS.get(getattr(st.node, "op", None))
    made = own(pc, st, ins, outs) if own is not None else None
    return planner(pc, st, ins, outs) if made is None and planner is not None else made


def out_kind(op, outs, planner) -> str | None:
    """'f32' where the step's results are float32 and a planner may take it, 'bool' where
    they are bool and a planner of bool values may, else None (a torch record)."""
    if all(m.dtype == _F32 for m in outs):
        return "f32" if planner is not None or op in (Q.Cast, M.Where) else None
    if all(m.dtype == torch.bool for m in outs) and (
            op in PLANNERS or (op in _VIEWS and planner is not None)):
        return "bool"
    return None


def inputs(pc, st, op) -> list:
    """The step's inputs as program values for its planner: a bool value only where the op
    takes bool values (None elsewhere, so the step stays a torch record); a small bool
    constant or folded result as a float 0/1 constant where it does."""
    takes = op in _TAKE_BOOL
    out = []
    for i in st.ins:
        v = pc.vals.get(i) if i >= 0 else None
        if v is not None and i in pc.boolf and not takes:
            v = None
        elif v is None and takes and i >= 0:
            t = pc.const(i)
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() <= RANK:
                f = t.to(_F32).contiguous()
                v = pc.vals[i] = Val(tuple(f.shape), contiguous_strides(f.shape),
                                     pc.fixed(f), 0, i)
                pc.boolf.add(i)
        out.append(v)
    return out
