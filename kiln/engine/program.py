"""Native programs (CPU): a whole executor step list run by kiln's C interpreter
(``kiln_chain_run``), with a step it has no record for run by its PyTorch kernel in between.

The per-layer cost of walking launch records in Python (~8 us: the loop, the kernel's wrapper,
the torch call) is the whole time of a model made of many small layers. Here the steps whose op
has a planner in :mod:`kiln.engine.program_ops` (elementwise ops, views, concatenation, pooling,
kiln's convolutions) become records of one program; the interpreter runs records until it meets
a *torch record*, returns its position, Python runs that step's kernel on tensors that view the
program's memory, puts the result's address in the table, and the interpreter goes on.

A program is planned per input signature (shapes, strides, dtypes) from a traced run: the first
call with a signature runs the steps one by one, notes what every value looks like (shape,
strides, dtype, which input a torch step's result is a view of), and plans from that; later
calls run the program. Float32 values made by records live in an arena (offsets reused once a
value is dead), one arena per concurrent call, taken from a pool; outputs get their own
tensors. A step a planner declines runs as a torch record, so every plan is complete.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from typing import NamedTuple

import torch

from kiln import native
from kiln.engine import gc_pause
from kiln.engine.step import kernel_error, store_outputs
from kiln.errors import KilnError

OP_TORCH = 100  # a record the C library does not know: [OP_TORCH, fallback index]
OP_GATHER = 15  # program_bool's Gather by run-time indices: the C library stops at a bad one
_MAX_PLANS = 4
# A torch record touching fewer elements than this (inputs, weights and outputs) runs on one
# thread: an OpenMP region costs more than such an op's work, and on a busy machine far more
# (the second thread waits for a core: torch.tanh of 1,024 floats took 26 ms on 2 threads of a
# loaded 2-core VM, 9 us on one; a [1, 128] x [128, 512] matmul 134 us against 14 us)
SMALL_WORK = 1 << 17
# A plan whose steps touch more than this many activation elements on average (weights not
# counted) runs on the Python loop, where per-layer dispatch is a negligible part of each
# layer's time. Was 1 << 17 (PaddleOCR det v4 at 640x640 ran slower as a program in session 6);
# since the conv records and folds of session 8 the program wins at every size tried
# (2026-12-03, 2 threads, interleaved in one process, OMP_WAIT_POLICY=PASSIVE: ppocr_det_v4
# 320x320 14.5 -> 11.8 ms, 640x640 37.6 -> 32.6 ms, tv_mobilenet_v3_large_dynamo 6.4 -> 4.0 ms;
# onnxruntime 15.0, 40.9, 3.8 ms), so only very large activations stay on the loop
MAX_MEAN_WORK = 1 << 24
# integer results up to this many elements are kept from the traced run, for _foldable
FOLD_MAX = 64
# a program keyed on input values traces at most this many signatures (values that change
# every run would trace every run: the Python loop is faster then)
_MAX_KEYED_TRACES = 4 * _MAX_PLANS
_F32 = torch.float32


class Meta(NamedTuple):
    """What a traced value looked like."""
    shape: tuple
    strides: tuple
    dtype: torch.dtype
    view_of: tuple  # input positions of its step whose storage it shares


class Val(NamedTuple):
    """A float32 value the interpreter can read: table buffer ``buf``, element offset ``off``,
    ``strides`` over ``shape``; ``root`` is the value whose memory it is (liveness)."""
    shape: tuple
    strides: tuple
    buf: int
    off: int
    root: int


def contiguous_strides(shape) -> tuple:
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= max(1, d)
    return tuple(reversed(out))


def view_strides(shape, strides, new_shape) -> tuple | None:
    """Strides that show the elements of a (``shape``, ``strides``) value, read in row-major
    order, as ``new_shape`` without moving them (a reshape as a view), or None where no strides
    can: dims are merged only where they step evenly into each other and split only within
    such a run, torch's rule for ``view`` (a transposed [H, S, D] value seen as [H*S, D] can
    not be, as [H, S, 2, D/2] can)."""
    new_shape = tuple(new_shape)
    if math.prod(shape) == 0 or math.prod(shape) != math.prod(new_shape):
        return contiguous_strides(new_shape) if math.prod(shape) == math.prod(new_shape) \
            else None
    # runs of dims that step evenly into each other (size-1 dims dropped): (size, stride)
    runs: list[list[int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if runs and runs[-1][1] == s * n:
            runs[-1] = [runs[-1][0] * n, s]
        else:
            runs.append([n, s])
    out = [0] * len(new_shape)
    d = len(new_shape) - 1
    for size, stride in reversed(runs):
        got = 1
        while d >= 0 and (got < size or new_shape[d] == 1):
            out[d] = got * stride
            got *= new_shape[d]
            d -= 1
        if got != size:
            return None  # a new dim straddles two runs
    while d >= 0:  # leading size-1 dims
        out[d] = 1 if not runs else runs[0][0] * runs[0][1]
        d -= 1
    return tuple(out)


def channels_last_strides(shape) -> tuple:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def is_contiguous(v: Val) -> bool:
    return all(d == 1 or s == e for d, s, e in zip(v.shape, v.strides,
                                                   contiguous_strides(v.shape)))


def is_channels_last(v: Val) -> bool:
    return len(v.shape) == 4 and all(d == 1 or s == e for d, s, e in zip(
        v.shape, v.strides, channels_last_strides(v.shape)))


def _meta(x, ins) -> Meta | None:
    if not isinstance(x, torch.Tensor):
        return None
    views = ()
    if x.numel():
        p = x.untyped_storage().data_ptr()
        views = tuple(k for k, t in enumerate(ins) if isinstance(t, torch.Tensor) and t.numel()
                      and t.untyped_storage().data_ptr() == p)
    return Meta(tuple(x.shape), tuple(x.stride()), x.dtype, views)


class _Fallback(NamedTuple):
    step: object
    ins: tuple
    outs: tuple
    native_outs: tuple  # (slot, buffer, shape, strides) of float32 results records read
    drop: tuple  # env slots not read again from here on
    single: bool  # small work: run on one thread (see SMALL_WORK)


class _Plan:
    def __init__(self, pc, fallbacks, ext, outputs, arena_floats):
        self.prog = (ctypes.c_long * max(1, len(pc.prog)))(*pc.prog)
        self.addr = ctypes.addressof(self.prog)
        self.n = len(pc.prog)
        self.fp = (ctypes.c_float * max(1, len(pc.fparams)))(*pc.fparams)
        self.table = (ctypes.c_void_p * len(pc.table))(*pc.table)
        self.keep = pc.keep
        self.kinds = pc.kinds  # the records' kinds, torch records left out
        self.arena_buf = pc.arena_buf
        self.arena_floats = arena_floats
        # where torch records find arena values: offsets from the arena's start
        self.arena_vals = {s: v._replace(off=pc.arena_off[v.root] + v.off)
                           for s, v in pc.vals.items()
                           if v.buf == pc.arena_buf and v.root in pc.arena_off}
        # views of inputs, torch results and constants that torch records read: (source slot,
        # whether it is a constant, shape, strides, offset)
        self.views = {s: (*pc.buf_src[v.buf], v.shape, v.strides, v.off)
                      for s, v in pc.vals.items() if v.buf in pc.buf_src}
        self.fallbacks = fallbacks
        self.rec_step = dict(pc.rec_step)  # record position -> its step (in self.steps)
        self.steps = pc.steps
        self.ext = ext  # (slot, buffer) of the float32 inputs
        self.outputs = outputs  # per graph output: ("env", slot) or ("own", buffer, shape)
        self.own = [(b, shape) for kind, *rest in outputs if kind == "own"
                    for b, shape in [rest]]
        self.pool: list = []
        self.folded: dict = {}  # slot -> the traced value of a step fixed by the signature
        self.consts: dict = {}  # slot -> constant (the program's and its inlined branches')
        self.boolf: frozenset = frozenset()  # bool values records keep as float 0/1
        self.lock = threading.Lock()


class Program:
    """Runs ``steps`` (an executor's run steps) as one native program per input signature."""

    def __init__(self, steps: list, input_slots: list, consts: dict, output_slots: list,
                 keyed: tuple = ()):
        from kiln.engine import planners  # noqa: F401  (imported at load, not at first run)

        self.steps, self.input_slots = steps, input_slots
        self.consts, self.output_slots = consts, output_slots
        self.plans: dict = {}
        self.packed: dict = {}  # weight slot -> its kiln GEMM packing (shared by the plans)
        self._lock = threading.Lock()
        self.traced = 0  # traced runs (one per signature planned; tests count them)
        self.disabled = False  # a step's output shape or layout depends on data: no programs
        # positions of the (integer) inputs whose values may set a shape or branch: a plan is
        # made per value of these (up to FOLD_MAX elements each), which fixes what they set
        self.keyed = tuple(keyed)
        # the per-record profile (None: off): (node name, op, kind) -> seconds per run, native
        # records timed in C (kiln_chain_run_timed), torch records around their kernel call
        self.profile: dict | None = None

    def run(self, args: list, call) -> list | None:
        """One run, or None where this signature has no program (the executor then runs the
        steps itself). ``call(step, inputs)`` runs one step the executor's way."""
        if self.disabled:
            return None
        sig = tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor)
                    else type(x) for x in args)
        if self.keyed:
            values = _key_values(args, self.keyed)
            if values is None:
                return None
            sig += values
        plan = self.plans.get(sig)
        if plan is None:
            with gc_pause.paused():  # the trace and plan make the plan's long-lived objects
                return self._trace(sig, args, call)
        if plan is False:
            return None
        try:
            return self._run(plan, args)
        except _DataDependent:  # nothing the run wrote is kept: the executor runs the steps
            self.disabled = True
            return None

    # -- the traced run and planning ------------------------------------------------------------
    def _trace(self, sig, args, call) -> list:
        from kiln.engine import program_inline

        consts = dict(self.consts)  # and those of If branches inlined into this plan
        env: dict = dict(consts)
        env.update(zip(self.input_slots, args))
        metas = {s: _meta(x, ()) for s, x in env.items()}
        small: dict = {}  # small integer results, which a plan may fold (_foldable)
        fixed = set(consts)  # slots whose values the signature fixes (program_inline)
        for k in self.keyed:  # their values are the signature's
            fixed.add(self.input_slots[k])
            small[self.input_slots[k]] = args[k].clone()
        inline = program_inline.Inliner(self.steps, self.input_slots, self.output_slots, consts)
        steps, queue = [], list(reversed(self.steps))
        while queue:
            st = queue.pop()
            branch = inline.branch(st, env, fixed, metas)
            if branch is not None:  # the If's taken branch, planned in its place
                queue += reversed(branch)
                continue
            steps.append(st)
            # the inputs as a planned run hands them over (broadcast views copied out), so that
            # a result traced as a view has the layout it will have then (an Expand of an
            # Expand of a constant was traced as a broadcast view of another one, and stopped
            # the program at its first planned run)
            ins = [_unshared(env.get(i)) if i >= 0 else None for i in st.ins]
            store: dict = {}
            store_outputs(st, store, call(st, ins))
            for s, x in store.items():
                env[s] = x
                metas[s] = _meta(x, ins)
                if isinstance(x, torch.Tensor) and x.numel() <= FOLD_MAX and not (
                        x.dtype.is_floating_point or x.dtype.is_complex):
                    small[s] = x.clone()
            program_inline.note_fixed(st, ins, store, fixed, small)
            for s in st.free:
                env.pop(s, None)
        outs = [env[s] for s in self.output_slots]
        with self._lock:
            if sig not in self.plans:
                self.traced += 1
                if self.keyed and self.traced > _MAX_KEYED_TRACES:
                    self.disabled = True  # values vary run to run: the Python loop
                    return outs
                if len(self.plans) >= _MAX_PLANS:
                    del self.plans[next(iter(self.plans))]
                self.plans[sig] = self._plan(metas, small, steps, consts)
        return outs

    def _plan(self, metas: dict, small: dict | None = None, steps: list | None = None,
              consts: dict | None = None):
        """The plan for a traced run's ``metas`` (of ``steps``, the program's own where None,
        with ``consts``), or False where a planner failed (the signature then runs step by
        step; a planner bug must not break a model)."""
        try:
            return self._plan_records(metas, small or {}, self.steps if steps is None else steps,
                                      self.consts if consts is None else consts)
        except _Decline:
            return False

    def _plan_records(self, metas: dict, small: dict, steps: list, consts: dict) -> _Plan:
        from kiln.engine import planners, program_bool, program_ops

        work = sum(math.prod(m.shape) for st in steps for i in st.ins + st.outs
                   if i >= 0 and i not in consts for m in [metas.get(i)] if m is not None)
        if work > MAX_MEAN_WORK * max(1, len(steps)):
            raise _Decline

        pc = PlanContext(consts, self.packed)
        pc.steps = steps
        ext = []
        for s in self.input_slots:
            m = metas.get(s)
            if m is not None and m.dtype == _F32 and len(m.shape) <= 6:
                b = pc.new_buf((s, False))
                pc.vals[s] = Val(m.shape, m.strides, b, 0, s)
                ext.append((s, b))
        for s, c in consts.items():
            if isinstance(c, torch.Tensor) and c.dtype == _F32 and c.dim() <= 6:
                pc.vals[s] = Val(tuple(c.shape), tuple(c.stride()), pc.fixed(c, s), 0, s)
        for s in self.input_slots:  # integer and bool inputs: read by Cast records only
            m = metas.get(s)
            if m is not None and m.dtype in program_bool.INT_SOURCES and len(m.shape) <= 6:
                b = pc.new_buf((s, False))
                pc.ivals[s] = (Val(m.shape, m.strides, b, 0, s), m.dtype)
                ext.append((s, b))
        fallbacks = []
        folded = {s: small[s] for s in (self.input_slots[k] for k in self.keyed) if s in small}
        pc.folded = folded
        for k, st in enumerate(steps):
            pc.step = k
            if _foldable(st, pc, folded, small) and not set(st.outs) & set(self.output_slots):
                folded.update((s, small[s]) for s in st.outs)
                continue
            outs = [metas.get(s) for s in st.outs]
            op = getattr(st.node, "op", None)
            planner = planners.PLANNERS.get(op)
            made = None
            if _default_kernel(st) and all(m is not None for m in outs):
                kind = program_bool.out_kind(op, outs, planner)
                if kind is not None:
                    ins = program_bool.inputs(pc, st, op)
                    made = program_bool.plan(pc, st, ins, outs, planner)
                    if made is not None and kind == "bool":
                        pc.boolf.update(st.outs)
            if made is not None:
                pc.vals.update(zip(st.outs, made))
                continue
            ins = [pc.vals.get(i) if i >= 0 else None for i in st.ins]
            work = sum(math.prod(m.shape) for i in st.ins + st.outs if i >= 0
                       for m in [metas.get(i)] if m is not None)
            fallbacks.append(self._torch_record(pc, st, ins, outs, len(fallbacks),
                                                work < SMALL_WORK))
        pc.step = len(steps)
        outputs = []
        for s in self.output_slots:
            v = pc.vals.get(s)
            if v is not None and (v.root in pc.arena_roots or v.root in consts):
                b = pc.new_buf()
                program_ops.emit_copy(pc, v, Val(v.shape, contiguous_strides(v.shape), b, 0,
                                                 -1))
                outputs.append(("own", b, v.shape))
            else:
                outputs.append(("env", s))
        arena_floats = pc.place_arena()
        plan = _Plan(pc, _with_drops(fallbacks, pc, self.output_slots), ext, outputs,
                     arena_floats)
        plan.folded = folded
        plan.consts = consts
        plan.boolf = frozenset(pc.boolf)
        return plan

    @staticmethod
    def _torch_record(pc, st, ins, outs, index, single) -> _Fallback:
        pc.rec_step.append((len(pc.prog), pc.step))
        pc.prog += [OP_TORCH, index]
        pc.torch_at.append(pc.step)
        for i, v in zip(st.ins, ins):
            if i >= 0:
                pc.read_slot(i)
            pc.read(v)
        nat = []
        for s, m in zip(st.outs, outs):
            if m is None or m.dtype != _F32 or len(m.shape) > 6:
                continue
            roots = [ins[i].root for i in m.view_of if ins[i] is not None]
            for r in roots[1:]:
                pc.alias.setdefault(roots[0], []).append(r)
            b = pc.new_buf((s, False))
            pc.vals[s] = Val(m.shape, m.strides, b, 0, roots[0] if roots else s)
            nat.append((s, b, m.shape, m.strides))
        return _Fallback(st, st.ins, st.outs, tuple(nat), (), single)

    # -- running a plan -------------------------------------------------------------------------
    def _run(self, plan, args) -> list:
        table = type(plan.table).from_buffer_copy(plan.table)
        env: dict = dict(zip(self.input_slots, args))
        for s, b in plan.ext:
            table[b] = env[s].data_ptr()
        arena, views = None, {}
        if plan.arena_floats:
            with plan.lock:
                got = plan.pool.pop() if plan.pool else None
            arena, views = got or (torch.empty(plan.arena_floats, dtype=_F32), {})
            table[plan.arena_buf] = arena.data_ptr()
        own = {}
        for b, shape in plan.own:
            t = own[b] = torch.empty(shape, dtype=_F32)
            table[b] = t.data_ptr()
        nthreads = torch.get_num_threads()
        pos, n = 0, plan.n
        prof = self.profile
        acc = None
        if prof is not None:
            acc = (ctypes.c_double * max(1, n))()
        try:
            while True:
                if acc is None:
                    pos += native.chain_run(plan.addr + 8 * pos, n - pos, plan.fp, table,
                                            nthreads)
                else:
                    pos += native.chain_run_timed(plan.addr + 8 * pos, n - pos, plan.fp, table,
                                                  nthreads, ctypes.addressof(acc) + 8 * pos)
                if pos >= n:
                    break
                if plan.prog[pos] == OP_GATHER:  # an index out of range (program_bool)
                    st, size = plan.steps[plan.rec_step[pos]], plan.prog[pos + 3]
                    raise kernel_error(st, IndexError(
                        f"an index in '{st.node.inputs[1].name}' is out of range for axis "
                        f"{st.node.attrs.axis or 0} of size {size} (valid: {-size} to "
                        f"{size - 1}): pass indices in that range"))
                if plan.prog[pos] != OP_TORCH:
                    raise RuntimeError(f"native program: the C library stopped at position "
                                       f"{pos} (out of memory, or a record it does not know: "
                                       f"rebuild kiln with pip install -e .)")
                t0 = time.perf_counter() if acc is not None else 0.0
                self._fallback(plan, plan.fallbacks[plan.prog[pos + 1]], env, arena, views,
                               table)
                if acc is not None:
                    acc[pos] += time.perf_counter() - t0
                pos += 2
            if acc is not None:
                _note_profile(prof, plan, acc)
            outs = [own[o[1]] if o[0] == "own" else self._value(plan, o[1], env, arena, views)
                    for o in plan.outputs]
            if plan.boolf:  # bool results the records kept as float 0/1
                outs = [x != 0 if s in plan.boolf and x.dtype == _F32 else x
                        for s, x in zip(self.output_slots, outs)]
            return outs
        finally:
            if arena is not None:  # (its views stay with it: the next call reuses them)
                with plan.lock:
                    plan.pool.append((arena, views))

    def _value(self, plan, s, env, arena, views):
        if s in env:
            return env[s]
        if s in plan.consts:
            return plan.consts[s]
        if s in plan.folded:
            return plan.folded[s]
        v = views.get(s)
        if v is not None:
            return v
        a = plan.arena_vals.get(s)
        if a is not None:  # views of the arena are kept with the arena
            v = views[s] = arena.as_strided(a.shape, a.strides, a.off)
            return v
        src, is_const, shape, strides, off = plan.views[s]
        t = plan.consts[src] if is_const else env[src]
        return t.as_strided(shape, strides, t.storage_offset() + off)

    def _fallback(self, plan, fb: _Fallback, env, arena, views, table) -> None:
        st = fb.step
        xs = [None if i < 0 else _unshared(self._value(plan, i, env, arena, views))
              for i in fb.ins]
        if plan.boolf:  # bool values the records kept as float 0/1, as the kernel takes them
            xs = [x != 0 if i in plan.boolf and x.dtype == _F32 else x
                  for i, x in zip(fb.ins, xs)]
        threads = torch.get_num_threads() if fb.single else 1
        if threads > 1:
            torch.set_num_threads(1)
        elif torch.get_num_threads() > 1:  # torch's threads will want the cores kiln's hold
            native.team_rest()
        try:
            out = st.fn(st.call, *xs)
        except KilnError:
            raise
        except RuntimeError as e:
            if "refers to a single memory location" in str(e):
                raise _DataDependent from e  # wrote into a view the traced run did not give it
            raise kernel_error(st, e) from e
        except Exception as e:
            raise kernel_error(st, e) from e
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
        store_outputs(st, env, out)
        for s, b, shape, strides in fb.native_outs:
            t = env[s]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != _F32:
                raise _DataDependent(f"node '{st.node.name}': shape set by input values")
            if tuple(t.stride()) != strides:  # another layout than traced: the planned one
                t = env[s] = _in_layout(t, shape, strides, st.node.name)
            table[b] = t.data_ptr()
        for s in fb.drop:
            env.pop(s, None)


def _note_profile(prof: dict, plan, acc) -> None:
    """Add one timed run's record seconds to ``prof``: (node, op, record kind) -> the list of
    its seconds per run (a node of several records: their sum)."""
    run: dict = {}
    for pos, k in plan.rec_step.items():
        node = plan.steps[k].node if k < len(plan.steps) else None  # (None: output copies)
        kind = plan.prog[pos]
        key = (getattr(node, "name", "(outputs)"), getattr(getattr(node, "op", None), "name",
                                                         "copy"),
               "torch" if kind == OP_TORCH else RECORD_KINDS.get(kind, str(kind)))
        run[key] = run.get(key, 0.0) + acc[pos]
    for key, sec in run.items():
        prof.setdefault(key, []).append(sec)


# native record kinds (kiln/native/chain.c) by name, for the profile
RECORD_KINDS = {1: "gemm", 2: "layernorm", 3: "attention", 4: "pointwise", 5: "pool",
                6: "depthwise", 7: "winograd", 8: "rnn", 9: "rmsnorm", 10: "conv"}


def _foldable(st, pc, folded: dict, small: dict) -> bool:
    """Is this step's result fixed by the input signature, so that the plan keeps its traced
    value instead of running it? ``Shape``/``Size`` of a float32 program value (whose shape the
    plan fixes: a torch record's result that changes shape stops the program), and any step
    whose inputs are all constants or such folded values and whose results are all small
    integer tensors: the shape arithmetic exporters write (Shape -> Gather -> Unsqueeze ->
    Concat -> Reshape) when a dim is symbolic."""
    from kiln.ops import tensor as T

    if not st.outs or any(s not in small for s in st.outs) or st.node.subgraphs():
        return False
    op = getattr(st.node, "op", None)
    if op in (T.Shape, T.Size):
        return len(st.ins) >= 1 and (st.ins[0] in pc.vals or st.ins[0] in folded)
    return all(i < 0 or i in folded or i in pc.consts for i in st.ins)


def _key_values(args: list, keyed: tuple) -> tuple | None:
    """The values of the keyed inputs, for the signature; None where one is too large."""
    out = []
    for k in keyed:
        x = args[k]
        if not isinstance(x, torch.Tensor) or x.numel() > FOLD_MAX:
            return None
        out.append((k, tuple(x.reshape(-1).tolist())))
    return tuple(out)


def _in_layout(t: torch.Tensor, shape: tuple, strides: tuple, name: str) -> torch.Tensor:
    """``t`` copied into fresh memory with the traced ``strides``. A stride 0 over a dim of
    several elements (the traced result was a broadcast view: an Expand) keeps one row of
    that dim, the rest of the layout as traced: a record that wrote the input in another
    layout than torch's kernel did (a contiguous elementwise result where torch kept its input's
    transposed strides) must not stop the program."""
    if t.numel() == 0:
        return t
    reduced = tuple(1 if st == 0 else n for n, st in zip(shape, strides))
    src = t
    for d, (n, st) in enumerate(zip(shape, strides)):
        if st == 0 and n > 1:
            src = src.narrow(d, 0, 1)
    span = 1 + sum((n - 1) * st for n, st in zip(reduced, strides))
    buf = torch.empty(span, dtype=_F32)
    try:
        buf.as_strided(reduced, strides).copy_(src)
    except RuntimeError as e:  # a traced layout whose elements overlap
        raise _DataDependent(f"node '{name}': traced in a layout no copy can take") from e
    return buf.as_strided(shape, strides)


def _unshared(x):
    """A broadcast view (a stride 0 over a dim of several elements) copied out: torch kernels
    may write into their inputs' layout (``add_`` on a result), which such a view refuses."""
    if isinstance(x, torch.Tensor) and any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        return x.contiguous()
    return x


class _DataDependent(Exception):
    """A step gave another shape than in the traced run (its output shape depends on input
    values: Range, Compress, Expand by a computed shape, ...): programs cannot be planned."""


class _Decline(Exception):
    """A planner met what it cannot take after all (raised by :mod:`program_ops`)."""


def _with_drops(fallbacks, pc, output_slots):
    """Each torch record's ``drop``: env values (inputs, torch results) that nothing from that
    record on reads."""
    keep = set(output_slots)
    drops: dict[int, list[int]] = {}
    for s in set(pc.slot_read) | set(pc.last_read):
        if s in keep or s in pc.consts or s < 0:
            continue
        k = max(pc.slot_read.get(s, -1), pc.last_read.get(s, -1))
        nxt = next((i for i, j in enumerate(pc.torch_at) if j > k), None)
        if nxt is not None:
            drops.setdefault(nxt, []).append(s)
    return [fb._replace(drop=tuple(drops.get(i, ()))) for i, fb in enumerate(fallbacks)]


def _default_kernel(st) -> bool:
    """Does the step run its op's default CPU kernel? A planner computes what that kernel
    does; a step given another kernel (a tuned choice, a user's registration) keeps it, as a
    torch record."""
    from kiln.kernels.registry import kernels_for

    op = getattr(st.node, "op", None)
    ks = kernels_for(op, "cpu") if op is not None else []
    return bool(ks) and st.fn is ks[0].fn


class PlanContext:
    """What planners build a program with (see :mod:`kiln.engine.program_ops`)."""

    def __init__(self, consts: dict, packed: dict | None = None):
        self.consts = consts
        self.packed = {} if packed is None else packed  # weight slot -> PackedWeight
        self.prog: list[int] = []
        self.fparams: list[float] = []
        self.table: list[int] = [0]  # buffer 0: the arena
        self.arena_buf = 0
        self.keep: list = []
        self.vals: dict[int, Val] = {}
        self.step = 0
        self.born: dict[int, int] = {}
        self.last_read: dict[int, int] = {}  # slot or root -> last step reading it
        self.alias: dict[int, list[int]] = {}
        self.arena_roots: dict[int, int] = {}  # root -> size in floats
        self.arena_off: dict[int, int] = {}
        self.torch_at: list[int] = []  # the step of each torch record
        self.rec_step: list[tuple[int, int]] = []  # (program position, step) of each record
        self.steps: list = []
        self.slot_read: dict[int, int] = {}  # env slot -> last torch record step reading it
        self._next_tmp = -2
        self._patches: list[tuple[int, int]] = []  # (program position, arena root)
        self.buf_src: dict[int, tuple[int, bool]] = {}  # buffer -> (slot, is a constant)
        self.kinds: list[int] = []  # the kind of each record emitted (tests read them)
        self.folded: dict = {}  # slot -> traced value the signature fixes (_foldable)
        self.boolf: set[int] = set()  # slots of bool values kept as float 0/1 (program_bool)
        self.ivals: dict = {}  # integer/bool input slot -> (Val in its own elements, dtype)

    def const(self, slot: int):
        """The value of a constant, or of a step the plan folded (``_foldable``), else None."""
        c = self.consts.get(slot)
        return self.folded.get(slot) if c is None else c

    def new_buf(self, src: tuple | None = None) -> int:
        """A buffer filled per call; ``src`` = (slot, False): the env value it is."""
        self.table.append(0)
        if src is not None:
            self.buf_src[len(self.table) - 1] = src
        return len(self.table) - 1

    def fixed(self, t: torch.Tensor, slot: int | None = None) -> int:
        """A buffer whose address is fixed (a constant: ``slot`` its slot)."""
        self.keep.append(t)
        self.table.append(t.data_ptr())
        if slot is not None:
            self.buf_src[len(self.table) - 1] = (slot, True)
        return len(self.table) - 1

    def fparam(self, *xs: float) -> int:
        self.fparams += [float(x) for x in xs]
        return len(self.fparams) - len(xs)

    def alloc(self, shape, strides=None) -> Val:
        """A new value in the arena (a fresh root)."""
        root = self._next_tmp
        self._next_tmp -= 1
        self.arena_roots[root] = (math.prod(shape) + 15) // 16 * 16
        self.born[root] = self.step
        return Val(tuple(shape), tuple(strides or contiguous_strides(shape)), self.arena_buf,
                   0, root)

    def read_slot(self, s: int) -> None:
        self.slot_read[s] = self.step

    def read(self, *vals) -> None:
        """Note that the current step reads these values."""
        for v in vals:
            if v is not None:
                self.last_read[v.root] = max(self.last_read.get(v.root, 0), self.step)

    def place_arena(self) -> int:
        """Arena offsets for every arena root (first fit, space reused after a value's last
        reader), patched into the records; returns the arena size in floats."""
        for s, rs in self.alias.items():  # a torch view of several values keeps them all
            for r in rs:
                self.last_read[r] = max(self.last_read.get(r, 0), self.last_read.get(s, 0))
        spans = sorted((self.born[r], max(self.last_read.get(r, self.born[r]), self.born[r]),
                        r) for r in self.arena_roots)
        live: list[tuple[int, int, int]] = []  # (offset, size, dies)
        end = 0
        for b, d, r in spans:
            live = [x for x in live if x[2] >= b]
            size = self.arena_roots[r]
            off, taken = 0, sorted(live)
            for o, sz, _ in taken:
                if off + size <= o:
                    break
                off = max(off, o + sz)
            self.arena_off[r] = off
            live.append((off, size, d))
            end = max(end, off + size)
        for pos, root in self._patches:
            self.prog[pos] += self.arena_off[root]
        return end

    def put(self, rec: list, v: Val | None) -> None:
        """Append ``v``'s (buffer, offset) to the record being built, noting the read; an arena
        value's offset is patched in once the arena is laid out (after a marker that
        :meth:`emit` takes out)."""
        if v is None:
            rec += [-1, 0]
            return
        self.read(v)
        rec += [v.buf, v.off]
        if v.buf == self.arena_buf and v.root in self.arena_roots:
            rec.append(_ArenaMark(v.root))

    def emit(self, rec: list) -> None:
        """Append a finished record to the program."""
        self.kinds.append(rec[0])
        self.rec_step.append((len(self.prog), self.step))
        for x in rec:
            if isinstance(x, _ArenaMark):
                self._patches.append((len(self.prog) - 1, x.root))
            else:
                self.prog.append(x)


class _ArenaMark(NamedTuple):
    root: int
