"""Native chains (CPU): runs of consecutive steps that kiln's C library can execute, run as one
call with no Python or PyTorch code between them.

On this kind of machine every PyTorch call made after a large GEMM runs with its code and data
pushed out of the caches by the GEMM's stream of weights, and costs tens to hundreds of
microseconds; a transformer layer of five steps paid that five times. A chain is planned once
per input shape (what its external inputs look like, strides included) and becomes a flat
program for ``kiln_chain_run``: GEMMs with their fused epilogue (bias, residual, activation),
LayerNorms, and Slices along the last axis, which are views (an offset and a row stride) and
cost nothing. Values used only inside the chain live in an arena checked out of a per-chain
pool for the call (so concurrent contexts never share one); values read after the chain get
their own tensors, and so does any value a chain output is a view of.

What a chain computes is what its steps compute with the "kiln" GEMM tactic and the native
LayerNorm. A shape the program cannot take (a dtype other than float32, rows that do not
collapse to one stride, a residual that broadcasts) runs the member steps one by one as
before. ``KILN_CPU_CHAINS=0`` turns chains off, and so does pinning another CPU linear tactic
(``KILN_CPU_LINEAR``).
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import NamedTuple

import torch

from kiln import native
from kiln.engine.step import Step, kernel_error, store_outputs
from kiln.errors import KilnError
from kiln.ops import fused_conv as FC
from kiln.ops import fused_transformer as FT
from kiln.ops import nn as NN
from kiln.ops import tensor as T
from kiln.runtime import host
from kiln.settings import SETTINGS

_MIN_STEPS = 2  # a chain of one step saves nothing
_MAX_PLANS = 4  # input signatures planned per chain (oldest dropped first)
_OP_GEMM, _OP_LN, _OP_ATTN = 1, 2, 3


def enabled() -> bool:
    return native.available and SETTINGS.cpu_chains and SETTINGS.cpu_linear in ("", "kiln")


# ---- which steps can be members ---------------------------------------------------------------

def _const(v):
    return None if v is None else v.const


def _opt(ins, i: int):
    """Input ``i`` of a node, None where it is absent."""
    return ins[i] if len(ins) > i else None


def _float_vec(c, n=None) -> bool:
    return c is not None and c.ndim == 1 and str(c.dtype) == "float32" and (n is None
                                                                             or c.shape[0] == n)


def _member(node) -> bool:
    """Whether ``node`` can run inside a chain (checked once; shapes are checked per plan)."""
    op, ins = node.op, node.inputs
    if op in (FC.FusedMatMul, FC.FusedMatMulLayerNorm):
        w = _const(ins[1])
        if w is None or w.ndim != 2 or str(w.dtype) != "float32":
            return False
        if node.attrs.activation not in native.ACTIVATIONS:
            return False
        n = w.shape[1]
        b = _opt(ins, 2)
        if b is not None and not _float_vec(b.const, n):
            return False
        if op is FC.FusedMatMulLayerNorm:
            lb = _opt(ins, 5)
            if not _float_vec(_const(_opt(ins, 4)), n) or (lb is not None
                                                            and not _float_vec(lb.const, n)):
                return False
        return True
    if op is NN.LayerNormalization:
        a = node.attrs
        if len(node.outputs) != 1 or (a.axis is not None and a.axis != -1):
            return False
        sc, b = _const(ins[1]), _opt(ins, 2)
        return _float_vec(sc) and (b is None or _float_vec(b.const, sc.shape[0]))
    if op is FT.Attention:  # the [B, S, H*D] form; the mask, if any, must not be a constant
        return bool(node.attrs.num_heads) and all(v is None or v.const is None for v in ins)
    if op is T.Slice:
        cs = [_const(v) for v in ins[1:]]
        if len(cs) < 2 or any(c is None or c.size != 1 for c in cs):
            return False
        rank = ins[0].type.rank if ins[0].type is not None else None
        axis = int(cs[2].reshape(-1)[0]) if len(cs) > 2 else 0
        step = int(cs[3].reshape(-1)[0]) if len(cs) > 3 else 1
        return rank is not None and step == 1 and axis in (-1, rank - 1)
    return False


def chain_steps(steps: list, output_slots: list, const_slots: set, consts: dict) -> list:
    """``steps`` with every maximal run of at least two member steps replaced by one chain
    step."""
    readers: dict[int, list[int]] = {}
    for i, st in enumerate(steps):
        for s in st.ins:
            if s >= 0:
                readers.setdefault(s, []).append(i)
    out, run = [], []

    def flush():
        if len(run) >= _MIN_STEPS:
            out.append(_chain_step(run, steps, readers, output_slots, const_slots, consts))
        else:
            out.extend(st for _, st in run)
        run.clear()

    for i, st in enumerate(steps):
        if _member(st.node):
            run.append((i, st))
        else:
            flush()
            out.append(st)
    flush()
    return out


def _chain_step(run, steps, readers, output_slots, const_slots, consts):
    idx = {i for i, _ in run}
    made = [s for _, st in run for s in st.outs]
    last = max(idx)
    escaping = [s for s in made if s in output_slots or any(r > last or r not in idx
                                                            for r in readers.get(s, ()))]
    ins: list[int] = []
    for _, st in run:
        for s in st.ins:
            if s >= 0 and s not in made and s not in ins and s not in const_slots:
                ins.append(s)
    chain = Chain([st for _, st in run], tuple(ins), tuple(escaping), consts)
    return Step(chain, chain, tuple(ins), tuple(escaping), (), chain.node)


class _ChainNode:
    """What error messages and the executor read of a step's node."""

    class _Op:
        name = qualname = "NativeChain"

    op = _Op()

    def __init__(self, name: str):
        self.name = name


# ---- planning -----------------------------------------------------------------------------------

class _Unsupported(Exception):
    pass


class _Val(NamedTuple):
    """A planned value: torch ``shape``; a view of slot ``base`` (None: its own memory)
    starting ``off`` elements into each row; rows ``ld`` elements apart."""
    shape: tuple
    base: int | None
    off: int
    ld: int

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])


def _rows_view(t: torch.Tensor):
    """(rows, cols, row stride) when ``t``'s leading dims collapse to one row stride and its last
    dim is contiguous, else None."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() < 1 or t.numel() == 0:
        return None
    if t.dim() == 1:
        return 1, t.shape[0], t.shape[0]
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return None
    ld = t.stride(-2)
    for d in range(t.dim() - 2):
        if t.shape[d] != 1 and t.stride(d) != t.stride(d + 1) * t.shape[d + 1]:
            return None
    rows = t.numel() // t.shape[-1]
    return rows, t.shape[-1], ld


def _arena_offsets(order, values, own) -> tuple[dict[int, int], int]:
    """Arena offsets (in floats, 64-byte aligned) for the values the steps in ``order`` make
    that are neither views nor escaping (``own``), and the arena's size. A value's space is free
    again after the last step that reads it or a view of it; a step's outputs are placed before
    its inputs' space is freed, so no step writes over what it reads. First fit."""
    def root(s: int) -> int:
        v = values.get(s)
        return s if v is None or v.base is None else v.base

    last: dict[int, int] = {}
    for i, st in enumerate(order):
        for s in st.ins:
            if s in values:
                last[root(s)] = i
    dies: dict[int, list[int]] = {}
    offsets: dict[int, int] = {}
    sizes: dict[int, int] = {}
    free: list[list[int]] = []  # [offset, size], sorted by offset
    end = 0
    for i, st in enumerate(order):
        for s in st.outs:
            if values[s].base is not None or s in own:
                continue
            size = sizes[s] = (math.prod(values[s].shape) + 15) // 16 * 16
            k = next((k for k, (_, n) in enumerate(free) if n >= size), None)
            if k is None:
                offsets[s], end = end, end + size
            else:
                offsets[s] = free[k][0]
                free[k][0] += size
                free[k][1] -= size
                if not free[k][1]:
                    del free[k]
            dies.setdefault(max(last.get(s, i), i), []).append(s)
        for s in dies.pop(i, ()):
            free.append([offsets[s], sizes[s]])
            free.sort()
            merged = [free[0]]
            for off, n in free[1:]:
                if merged[-1][0] + merged[-1][1] == off:
                    merged[-1][1] += n
                else:
                    merged.append([off, n])
            free = merged
    return offsets, end


class _Plan:
    """The program for one input signature."""

    def __init__(self, prog, fparams, table, n_fixed, ext, owns, views, arena_floats, keep):
        self.prog = (ctypes.c_long * len(prog))(*prog)
        self.n = len(prog)
        self.fp = (ctypes.c_float * max(1, len(fparams)))(*fparams)
        self.table = table  # ctypes array of float*: constants filled, the rest per call
        self.n_fixed = n_fixed
        self.ext = ext  # buffer index per external input
        self.owns = owns  # (slot, shape, buffer index): values that get their own tensor
        self.views = views  # (slot, base slot, first column, columns): escaping views of them
        self.arena_floats = arena_floats
        self.keep = keep  # the tensors whose pointers the table holds
        self.pool: list[torch.Tensor] = []
        self.lock = threading.Lock()


class Chain:
    """One chain step: called by the executor as ``fn(call, *inputs)``; returns its escaping
    values in order."""

    def __init__(self, members: list, ins: tuple, outs: tuple, consts: dict):
        self.members, self.ins, self.outs = members, ins, outs
        names = [st.node.name for st in members]
        self.node_name = f"{names[0]} .. {names[-1]} ({len(names)} steps)"
        self.node = _ChainNode(self.node_name)
        self.consts = consts
        self.plans: dict = {}
        self._lock = threading.Lock()
        self._packed: dict[int, native.PackedWeight] = {}

    # the executor calls Step.fn(Step.call, *xs) with fn = call = self
    def __call__(self, _call, *xs):
        sig = tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor)
                    else None for x in xs)
        plan = self.plans.get(sig)
        if plan is None:
            with self._lock:
                plan = self.plans.get(sig)
                if plan is None:
                    try:
                        plan = self._plan(xs)
                    except _Unsupported:
                        plan = False
                    if len(self.plans) >= _MAX_PLANS:
                        del self.plans[next(iter(self.plans))]
                    self.plans[sig] = plan
        if plan is False:
            return self._stepwise(xs)
        return self._run(plan, xs)

    def _stepwise(self, xs):
        """The member steps one by one (a shape the program cannot take)."""
        env = dict(zip(self.ins, xs))
        for st in self.members:
            args = [None if i < 0 else env[i] if i in env else self.consts[i] for i in st.ins]
            try:
                out = st.fn(st.call, *args)
            except KilnError:
                raise
            except Exception as e:
                raise kernel_error(st, e) from e
            store_outputs(st, env, out)
        return tuple(env[s] for s in self.outs)

    def _run(self, plan: _Plan, xs):
        table = type(plan.table).from_buffer_copy(plan.table)  # concurrent callers: one each
        for b, x in zip(plan.ext, xs):
            table[b] = x.data_ptr()
        arena = None
        if plan.arena_floats:
            with plan.lock:
                arena = plan.pool.pop() if plan.pool else None
            if arena is None:
                arena = torch.empty(plan.arena_floats, dtype=torch.float32)
            table[plan.n_fixed] = arena.data_ptr()
        made = {}
        for slot, shape, b in plan.owns:
            t = made[slot] = torch.empty(shape, dtype=torch.float32)
            table[b] = t.data_ptr()
        for slot, base, start, width in plan.views:
            made[slot] = made[base].narrow(-1, start, width)
        rc = native.chain_run(plan.prog, plan.n, plan.fp, table)
        if arena is not None:
            with plan.lock:
                plan.pool.append(arena)
        if rc != plan.n:
            raise RuntimeError(f"native chain {self.node_name}: the C library stopped at "
                               f"position {rc} of its program (out of memory, or an op it does "
                               f"not know: rebuild kiln with pip install -e .)")
        return tuple(made[s] for s in self.outs)

    # -- planning -------------------------------------------------------------------------------
    def _plan(self, xs) -> _Plan:
        table: list[int] = []  # constant pointers first
        keep: list = []

        def fixed(t: torch.Tensor) -> int:
            keep.append(t)
            table.append(t.data_ptr())
            return len(table) - 1

        const_buf: dict[int, int] = {}

        def const(slot: int, vec_len: int | None = None) -> int:
            if slot < 0:
                return -1
            if slot not in const_buf:
                c = self.consts[slot]
                if (not isinstance(c, torch.Tensor) or c.dtype != torch.float32
                        or not c.is_contiguous() or (vec_len is not None
                                                     and tuple(c.shape) != (vec_len,))):
                    raise _Unsupported
                const_buf[slot] = fixed(c)
            return const_buf[slot]

        # pass 1: shapes, views and who is produced where
        ext_tensor = dict(zip(self.ins, xs))
        values: dict[int, _Val] = {}
        for s, x in ext_tensor.items():
            rv = _rows_view(x) if isinstance(x, torch.Tensor) else None
            if rv is None:
                raise _Unsupported
            values[s] = _Val(tuple(x.shape), None, 0, rv[2])
        prog: list[int] = []
        fparams: list[float] = []
        order = []
        for st in self.members:
            node = st.node
            if node.op in (FC.FusedMatMul, FC.FusedMatMulLayerNorm):
                xs_ = values.get(st.ins[0])
                if xs_ is None:
                    raise _Unsupported
                w = self.consts[st.ins[1]]
                if xs_.shape[-1] != w.shape[0] or len(xs_.shape) < 2:
                    raise _Unsupported
                values[st.outs[0]] = _Val(xs_.shape[:-1] + (w.shape[1],), None, 0, w.shape[1])
            elif node.op is FT.Attention:
                qv = values.get(st.ins[0])
                if qv is None or len(qv.shape) != 3:
                    raise _Unsupported
                a = node.attrs
                if a.qkv_split:
                    dv = a.qkv_split[2]
                else:
                    kv = [values.get(i) for i in st.ins[1:3]]
                    if any(v_ is None or len(v_.shape) != 3 for v_ in kv):
                        raise _Unsupported
                    dv = kv[1].shape[-1]
                values[st.outs[0]] = _Val(qv.shape[:-1] + (dv,), None, 0, dv)
            elif node.op is NN.LayerNormalization:
                xs_ = values.get(st.ins[0])
                if xs_ is None or xs_.shape[-1] != self.consts[st.ins[1]].shape[0]:
                    raise _Unsupported
                values[st.outs[0]] = _Val(xs_.shape, None, 0, xs_.shape[-1])
            else:  # Slice along the last axis: a view
                src = values.get(st.ins[0])
                if src is None:
                    raise _Unsupported
                shape, base, off, ld = src
                start, end = (int(self.consts[i].reshape(-1)[0]) for i in st.ins[1:3])
                dim = shape[-1]
                start = max(0, min(dim, start + dim if start < 0 else start))
                end = max(0, min(dim, end + dim if end < 0 else end))
                if end <= start:
                    raise _Unsupported
                root = st.ins[0] if base is None else base
                values[st.outs[0]] = _Val(shape[:-1] + (end - start,), root, off + start, ld)
            order.append(st)
        # escaping values, and the values escaping views are views of, get their own tensors
        own = {s if values[s].base is None else values[s].base for s in self.outs}
        if any(s in ext_tensor for s in own):  # a view of an input escapes: leave it to torch
            raise _Unsupported
        # arena offsets for the rest, reused once a value is dead: a chain can be a whole
        # encoder, and without reuse BERT-base b8's arena held every layer's activations
        n_fixed = len(table)
        table.append(0)  # the arena
        arena_off, arena_floats = _arena_offsets(order, values, own)
        ext_buf = {}
        for s in ext_tensor:
            table.append(0)
            ext_buf[s] = len(table) - 1
        out_buf = {}
        for s in own:
            table.append(0)
            out_buf[s] = len(table) - 1

        def operand(s: int):
            """(buffer, offset, row stride, rows) of value s."""
            v = values[s]
            root = s if v.base is None else v.base
            if root in ext_buf:
                return ext_buf[root], v.off, v.ld, v.rows
            if root in out_buf:
                return out_buf[root], v.off, v.ld, v.rows
            return n_fixed, arena_off[root] + v.off, v.ld, v.rows

        for st in order:
            node, a = st.node, st.node.attrs
            if node.op is T.Slice:
                continue
            if node.op is FT.Attention:
                prog += self._attention(st, values, operand, ext_tensor, fparams)
                continue
            if node.op is NN.LayerNormalization:
                xb, xo, xl, rows = operand(st.ins[0])
                yb, yo, yl, _ = operand(st.outs[0])
                n = values[st.ins[0]].shape[-1]
                g = const(st.ins[1], n)
                b = const(st.ins[2], n) if len(st.ins) > 2 else -1
                fparams.append(1e-5 if a.epsilon is None else float(a.epsilon))
                prog += [_OP_LN, rows, n, xb, xo, xl, yb, yo, yl, g, b, len(fparams) - 1]
                continue
            w = self.consts[st.ins[1]]
            k, n = w.shape
            pw = self._packed.get(st.ins[1])
            if pw is None:
                pw = self._packed[st.ins[1]] = native.PackedWeight(w)
                host.release_pages(w)  # packed: the weight's engine-file pages can go
            wb = fixed(pw.data)
            bias = const(st.ins[2], n) if len(st.ins) > 2 else -1
            xb, xo, xl, rows = operand(st.ins[0])
            rb, ro, rl = -1, 0, 0
            if len(st.ins) > 3 and st.ins[3] >= 0:
                r = st.ins[3]
                rv = values.get(r)
                if r in self.consts or rv is None or rv.shape != values[st.outs[0]].shape:
                    raise _Unsupported  # a constant or broadcasting residual
                rb, ro, rl, _ = operand(r)
            cb, co, cl, _ = operand(st.outs[0])
            lo, hi = native._epilogue_params(a.activation, a.alpha, a.beta)
            fparams += [lo, hi]
            prog += [_OP_GEMM, rows, n, k, xb, xo, xl, wb, bias, rb, ro, rl, cb, co, cl,
                     native.ACTIVATIONS[a.activation], len(fparams) - 2]
            if node.op is FC.FusedMatMulLayerNorm:
                g = const(st.ins[4], n)
                lb = const(st.ins[5], n) if len(st.ins) > 5 else -1
                fparams.append(a.epsilon)
                prog += [_OP_LN, rows, n, cb, co, cl, cb, co, cl, g, lb, len(fparams) - 1]
        tab = (ctypes.c_void_p * len(table))(*table)
        owns = [(s, values[s].shape, out_buf[s]) for s in own]
        views = [(s, values[s].base, values[s].off, values[s].shape[-1])
                 for s in self.outs if values[s].base is not None]
        return _Plan(prog, fparams, tab, n_fixed, [ext_buf[s] for s in self.ins], owns, views,
                     arena_floats, keep)

    def _attention(self, st, values, operand, ext_tensor, fparams) -> list:
        """The OP_ATTN record of a fused Attention ([B, S, H*D] q, k, v; or one merged
        projection's output with qkv_split)."""
        a, ins = st.node.attrs, st.ins
        h = a.num_heads
        qshape = values[ins[0]].shape
        if a.qkv_split:
            dq, dk, dvt = a.qkv_split
            qb_, qo, ql, _ = operand(ins[0])
            parts = [(qb_, qo, ql, qshape), (qb_, qo + dq, ql, qshape),
                     (qb_, qo + dq + dk, ql, qshape)]
        else:
            dq, dk, dvt = (values[i].shape[-1] for i in ins[:3])
            parts = [(*operand(i)[:3], values[i].shape) for i in ins[:3]]
        if dq != dk or dq % h or dvt % h:
            raise _Unsupported
        b, sq = qshape[0], qshape[1]
        skv = parts[1][3][1]
        if parts[1][3][0] != b or parts[2][3][:2] != (b, skv):
            raise _Unsupported
        rec = [_OP_ATTN, b, h, h, sq, skv, dq // h, dvt // h]
        for (buf, off, ld, shape), width in zip(parts, (dq // h, dq // h, dvt // h)):
            rec += [buf, off, shape[1] * ld, width, ld]  # batch, head and row strides
        mask = ins[3] if len(ins) > 3 else -1
        if mask >= 0:
            m = ext_tensor.get(mask)
            if m is None or m.dtype != torch.float32 or m.dim() > 4:
                raise _Unsupported  # made inside the chain, or not an additive float mask
            try:
                me = m.expand(b, h, sq, skv)
            except RuntimeError:
                raise _Unsupported from None
            mb, mo, _, _ = operand(mask)
            rec += [mb, mo, *me.stride()]
        else:
            rec += [-1, 0, 0, 0, 0, 0]
        fparams.append(float(a.scale))
        rec += [0 if a.causal else -1, len(fparams) - 1]
        yb, yo, yl, _ = operand(st.outs[0])
        rec += [yb, yo, sq * yl, dvt // h, yl]
        return rec
