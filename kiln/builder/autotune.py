"""Build-time kernel and tactic selection, with a timing cache on disk.

For a node, the candidates are its CUDA kernels (each with every tactic of its space that it
supports for these inputs) plus the PyTorch kernel, which on CUDA tensors *is* the vendor
library (cuBLAS/cuBLASLt, cuDNN, SDPA). Each candidate is timed on the device at the profile's
opt shapes (median of several runs); the fastest is kept and the runner-up reported, as
TensorRT's verbose log does. The timing cache maps a candidate's signature (op, kernel, tactic,
attributes, input shapes and dtypes) under a device key (GPU name, torch, triton and CUDA
versions) to its time, so a rebuild on the same machine times nothing. The clock is an argument
(``timer(fn) -> ms``): tests drive the selection with a fake one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.kernels.registry import Call, Kernel, kernels_for

CACHE_FORMAT = "kiln-timing-cache"
CACHE_VERSION = 1
FAILED = float("inf")  # the time of a candidate that raised or gave wrong results
PRUNE_KEEP = 3  # candidates timed in full after the quick estimates (see select)
# What a fresh process pays once for a CUDA library at its first use, in ms on the H200
# (python -m bench.cold_parts, 2026-12-03: cuBLAS 150-170, PyTorch's SDPA kernels ~125,
# cuDNN 0.3-1 s with its first plans), and for each further cuDNN plan (one per layer shape).
# plan_payback weighs them against the time a faster library kernel saves per inference.
LIBRARY_START_MS = {"cublas": 170.0, "sdpa": 125.0, "cudnn": 1000.0}
PLAN_MS = 5.0

# |candidate - reference| <= atol + rtol * |reference|, per output dtype
TOLERANCE = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 5e-2),
             torch.float32: (1e-3, 1e-3),
             # FP8 codes an 8-bit layer hands off: one e4m3 step (1/8) where two kernels'
             # float results round to either side of a half (int8 codes are not compared)
             torch.float8_e4m3fn: (2e-2, 0.13)}


@dataclass(frozen=True)
class Candidate:
    kernel: Kernel
    tactic: dict | None = None

    @property
    def label(self) -> str:
        return label(self.kernel.name, self.tactic)


def label(kernel_name: str, tactic: dict | None) -> str:
    """``TritonGemm[BLOCK_M=128,...]``: how logs and reports name a candidate."""
    if not tactic:
        return kernel_name
    return kernel_name + "[" + ",".join(f"{k}={v}" for k, v in sorted(tactic.items())) + "]"


@dataclass
class Selection:
    """What the autotuner decided for one node."""

    node: str
    kernel: str
    tactic: dict | None
    ms: float
    runner_up: tuple[str, float] | None = None  # (candidate label, ms)
    timed: int = 0  # candidates timed now
    cached: int = 0  # candidates whose time came from the cache
    failed: list[str] = field(default_factory=list)  # "label: why"
    pruned: int = 0  # candidates only estimated: slower than the ones timed in full
    # kept over a faster runner-up that loads a CUDA library at first run (plan_margin)
    plan_free: bool = False
    # the CUDA library the pick initialises at its first call (Kernel.library), and where it
    # does, the fastest candidate that needs none (label, kernel name, tactic, ms), for the
    # engine-wide rule (:func:`drop_plans`)
    library: str | None = None
    planless: tuple[str, str, dict | None, float] | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        s = f"{self.node}: {label(self.kernel, self.tactic)} {self.ms:.4f} ms"
        if self.runner_up:
            why = (", which loads a CUDA library (cuDNN, cuBLAS or SDPA) at first run"
                   if self.plan_free else "")
            s += f" (runner-up {self.runner_up[0]} {self.runner_up[1]:.4f} ms{why})"
        return s


# ---------------------------------------------------------------- signatures and the cache


def device_key() -> dict:
    """The machine a timing belongs to: a cached time is reused only on an identical one."""
    from kiln.runtime.cuda import triton_version  # package metadata: no triton import

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton_version(),
            "cuda": torch.version.cuda}


def cpu_device_key() -> dict:
    """The machine a CPU tactic pick belongs to: CPU model, core count, torch version."""
    model = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"device": model, "cores": os.cpu_count(), "torch": torch.__version__}


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return {"array": list(x.shape), "dtype": str(x.dtype), "sum": float(x.sum())}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _describe(x):
    if isinstance(x, torch.Tensor):
        return [list(x.shape), str(x.dtype).removeprefix("torch."), list(x.stride())]
    return None if x is None else type(x).__name__


# calibrated quantization parameters: their values never change a kernel's time, only whether
# they are set (a dynamic x_scale of 0, an output handed off as codes): a signature keeps that,
# so the layers of a quantized model's repeated blocks share their timings (BERT-base: 4 INT8
# GEMM kinds timed, not 48 layers)
TIMING_NEUTRAL = frozenset({"x_scale", "x_zero", "out_scale", "out_zero", "zshift"})


def signature(op, kernel_name: str, tactic: dict | None, attrs, inputs) -> str:
    """One candidate at one node's inputs, as a stable string."""
    a = {f.name: _jsonable(getattr(attrs, f.name)) for f in dataclasses.fields(attrs)} \
        if dataclasses.is_dataclass(attrs) else {}
    for k in TIMING_NEUTRAL & a.keys():
        a[k] = bool(a[k])
    return json.dumps({"op": op.qualname, "kernel": kernel_name, "tactic": tactic or {},
                       "attrs": a, "inputs": [_describe(x) for x in inputs]},
                      sort_keys=True, separators=(",", ":"))


_PROCESS_TIMES: dict[str, dict[str, float | str]] = {}  # TimingCache(None): per process


class TimingCache:
    """Times per (device, candidate signature), kept in a JSON file.

    A missing file starts empty; an unreadable one too (with a warning through ``log``), so a
    damaged cache costs a re-timing, never a failed build. ``save`` writes atomically.

    Without a ``path`` the times are the process's: every build in one process shares them,
    so a second build with the same layer shapes (an FP32 check next to a fixed-profile build,
    another profile, the same block repeated in another model) times nothing again."""

    def __init__(self, path: str | os.PathLike | None, device: dict,
                 log: Callable[[str], None] = lambda msg: None):
        self.path = Path(path) if path else None
        self.device = json.dumps(device, sort_keys=True)
        self.entries: dict[str, dict[str, float | str]] = {} if path else _PROCESS_TIMES
        self.hits = self.misses = 0
        self._dirty = False
        if self.path and self.path.exists():
            try:
                d = json.loads(self.path.read_text())
                if d.get("format") != CACHE_FORMAT or d.get("version") != CACHE_VERSION:
                    raise ValueError(f"not a {CACHE_FORMAT} v{CACHE_VERSION} file")
                self.entries = {k: dict(v) for k, v in d["entries"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log(f"timing cache {self.path} ignored ({e}); kernels will be re-timed")

    def get(self, sig: str) -> float | None:
        e = self.lookup(sig)
        return None if e is None else e[0]

    def lookup(self, sig: str) -> tuple[float, bool] | None:
        """``(ms, pruned)`` for a candidate timed before, or None. ``pruned``: the time is a
        quick estimate of a candidate that was not among the fastest (see :func:`select`)."""
        e = self.entries.get(self.device, {}).get(sig)
        if e is None:
            self.misses += 1
            return None
        self.hits += 1
        if e == "failed":
            return FAILED, False
        if isinstance(e, str) and e.startswith("pruned:"):
            return float(e[7:]), True
        return float(e), False

    def put(self, sig: str, ms: float, pruned: bool = False) -> None:
        self.entries.setdefault(self.device, {})[sig] = (
            "failed" if ms == FAILED else f"pruned:{ms!r}" if pruned else ms)
        self._dirty = True

    def picks(self) -> dict:
        """The CPU tactic picks stored under this device (signature JSON -> tactic name)."""
        return {k[5:]: v for k, v in self.entries.get(self.device, {}).items()
                if k.startswith("pick:") and isinstance(v, str)}

    def put_picks(self, picks: dict) -> None:
        for k, v in picks.items():
            self.entries.setdefault(self.device, {})["pick:" + k] = v
        self._dirty = self._dirty or bool(picks)

    def save(self) -> None:
        if not self.path or not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION,
                                   "entries": self.entries}, indent=1, sort_keys=True))
        tmp.replace(self.path)
        self._dirty = False


# ---------------------------------------------------------------- selection


def vendor_kernel(op) -> Kernel | None:
    """The PyTorch kernel: on CUDA tensors it calls cuBLAS / cuDNN / SDPA."""
    ks = kernels_for(op, "cpu")
    return ks[0] if ks else None


def candidates(op, call: Call, inputs, backend: str = "cuda") -> list[Candidate]:
    """Every (kernel, tactic) that can run this node; the PyTorch kernel last."""
    out = []
    for k in kernels_for(op, backend):
        if k.can_run(call, inputs):
            out += [Candidate(k, t) for t in k.tactic_space(call, inputs)]
    v = vendor_kernel(op)
    if v is not None:
        out.append(Candidate(v))
    return out


def _outputs(y) -> list:
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _close(got, want) -> bool:
    for g, w in zip(_outputs(got), _outputs(want)):
        if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape:
            return False
        atol, rtol = TOLERANCE.get(w.dtype, (1e-3, 1e-3))
        if not torch.allclose(g.float(), w.float(), atol=atol, rtol=rtol, equal_nan=True):
            return False
    return True


def select(node_name: str, op, call: Call, inputs, cands: list[Candidate],
           timer: Callable[[Callable], float], cache: TimingCache | None = None,
           verify: bool = True, plan_margin: float = 0.0, keep: int = PRUNE_KEEP,
           plan_payback: int = 0) -> Selection:
    """Time ``cands`` (or read their times from ``cache``) and keep the fastest.

    ``verify``: each candidate's outputs are first compared with the PyTorch kernel's; one that
    differs (or raises) is recorded as failed and never chosen.

    ``keep``: where the timer also gives a quick estimate (``timer.estimate(fn) -> ms``, a few
    calls in one CUDA graph) and more than ``keep`` candidates are left to time, every one is
    estimated first and only the ``keep`` fastest estimates are timed in full, with the PyTorch
    kernel (the reference every tactic must beat) and the fastest one that makes no cuDNN plan.
    The others keep their estimate, are ranked after every fully timed candidate and are
    counted in ``Selection.pruned`` (TensorRT's builder likewise drops tactics its first pass
    rates slow). 0: time every candidate in full.

    ``plan_margin``: where the fastest candidate makes a library plan at its first call
    (``Kernel.makes_plan``: cuDNN), the fastest one that doesn't is kept instead if it is at
    most this fraction slower; the plan-making one is then the runner-up. An engine of such
    kernels runs its first inference from its embedded binaries alone. ``plan_payback`` (> 0):
    and only if the time it loses per run, over that many runs, is no more than the plan it
    spares (``PLAN_MS``): a large-batch layer, where 25% is a lot of time, keeps the fastest."""
    if not cands:
        raise ValueError(f"node '{node_name}': no candidate kernels")
    ref = None
    ranked: list[tuple[bool, float, int, Candidate]] = []  # (pruned, ms, order, candidate)
    pending: list[tuple[int, Candidate, str, Callable]] = []  # to time now
    sel = Selection(node_name, "", None, FAILED)

    def failed(c: Candidate, sig: str, e: Exception) -> None:
        sel.failed.append(f"{c.label}: {type(e).__name__}: {str(e)[:200]}")
        sel.timed += 1
        if cache is not None:
            cache.put(sig, FAILED)

    for i, c in enumerate(cands):
        sig = signature(op, c.kernel.name, c.tactic, call.attrs, inputs)
        hit = cache.lookup(sig) if cache is not None else None
        if hit is not None:
            sel.cached += 1
            if hit[0] == FAILED:
                sel.failed.append(f"{c.label}: failed when timed earlier (cached)")
            else:
                ranked.append((hit[1], hit[0], i, c))
            continue
        fn = _bind(c.kernel.fn, dataclasses.replace(call, tactic=c.tactic, cache={}), inputs)
        if verify and c.kernel.backend != "cpu":
            try:
                with torch.inference_mode():
                    if ref is None:
                        ref = _reference(op, call, inputs)
                    if ref is not None and not _close(fn(), ref):
                        raise ValueError("outputs differ from the PyTorch kernel's")
            except Exception as e:
                failed(c, sig, e)
                continue
        pending.append((i, c, sig, fn))

    estimate = getattr(timer, "estimate", None)
    if estimate is not None and keep and len(pending) > keep:
        est = {}
        for i, c, sig, fn in pending:
            try:
                est[i] = float(estimate(fn))
            except Exception as e:
                failed(c, sig, e)
        alive = sorted((r for r in pending if r[0] in est), key=lambda r: (est[r[0]], r[0]))
        full = alive[:keep]
        extra = [r for r in alive[keep:] if r[1].kernel.backend == "cpu"]
        # the fastest candidate that needs no CUDA library is timed in full too where none
        # of those is one: plan_margin and drop_plans weigh the libraries against it (SDPA's
        # and cuBLAS's as well as cuDNN's; with cuDNN's alone, BERT's Triton attention went
        # unmeasured and SDPA was kept as 'the only kernel')
        if all(r[1].kernel.library(r[1].tactic) is not None for r in full):
            extra += [r for r in alive[keep:]
                      if r[1].kernel.library(r[1].tactic) is None][:1]
        full += [r for r in extra if r not in full]
        for r in alive:
            if r not in full:
                i, c, sig, _ = r
                ranked.append((True, est[i], i, c))
                sel.timed += 1
                sel.pruned += 1
                if cache is not None:
                    cache.put(sig, est[i], pruned=True)
        pending = full
    for i, c, sig, fn in pending:
        try:
            with torch.inference_mode():
                ms = float(timer(fn))
        except Exception as e:
            failed(c, sig, e)
            continue
        sel.timed += 1
        if cache is not None:
            cache.put(sig, ms)
        ranked.append((False, ms, i, c))
    if not ranked:
        raise RuntimeError(f"node '{node_name}': every candidate failed: {sel.failed}")
    ranked.sort(key=lambda r: (r[0], r[1], r[2]))  # timed in full first; ties: registration
    timed = [(ms, i, c) for _, ms, i, c in ranked]
    full_count = sum(not r[0] for r in ranked) or len(ranked)
    if timed[0][2].kernel.plans(timed[0][2].tactic):
        planless = [r for r in timed[:full_count] if not r[2].kernel.plans(r[2].tactic)]
        if planless and planless[0][0] <= timed[0][0] * (1.0 + plan_margin) and (
                plan_payback <= 0 or (planless[0][0] - timed[0][0]) * plan_payback <= PLAN_MS):
            timed.remove(planless[0])
            timed.insert(0, planless[0])
            sel.plan_free = True
    best = timed[0]
    sel.kernel, sel.tactic, sel.ms = best[2].kernel.name, best[2].tactic, best[0]
    sel.library = best[2].kernel.library(best[2].tactic)
    if sel.library is not None:
        free = [r for r in timed[:full_count] if r[2].kernel.library(r[2].tactic) is None]
        if free:
            ms, _, c = free[0]
            sel.planless = (c.label, c.kernel.name, c.tactic, ms)
    if len(timed) > 1:
        sel.runner_up = (timed[1][2].label, timed[1][0])
    return sel


def untuned_libraries(graph, picks: dict[str, Selection]) -> set[str]:
    """The CUDA libraries that layers the autotuner did not tune (their PyTorch kernel alone
    runs them) load at the first run anyway: a squeeze-excite's cuBLAS GEMMs, say."""
    libs = set()
    for n in _nodes(graph):
        if n.name not in picks and not kernels_for(n.op, "cuda"):
            k = vendor_kernel(n.op)
            lib = k.library(None) if k is not None else None
            if lib is not None:
                libs.add(lib)
    return libs


def drop_plans(picks: dict[str, Selection], margin: float, loaded: set[str] = frozenset(),
               payback: int = 0) -> list[tuple[str, int, float, bool]]:
    """The engine-wide half of ``plan_margin``. A process pays a CUDA library's initialisation
    once, at the first layer that uses it (cuDNN, cuBLAS, PyTorch's SDPA kernels: 0.1-1 s in a
    fresh process on the H200, ``python -m bench.cold_parts``), so the layers that picked a
    kernel of one library keep it only if, together, they save more than ``margin`` of the
    tuned layers' time. Otherwise each takes its fastest library-free candidate
    (``Selection.planless``), and the engine's first run never loads that library. Where a
    layer of the library has no library-free candidate, or the library is in ``loaded``
    (untuned layers use it: :func:`untuned_libraries`), it is loaded anyway and its layers
    keep their picks. ``payback`` (> 0): a library whose layers save more per run than its
    start-up (``LIBRARY_START_MS``) spread over that many runs is kept whatever the share (at
    a large batch, 12% of a BERT-base b64 pass is 0.5 ms a run: cuBLAS's 170 ms start-up is
    paid back in 340 runs). Returns, per library picked: (library, layers, ms they save per
    run, whether they were switched); the tuned layers' total is ``sum(s.ms)``."""
    total = sum(s.ms for s in picks.values())
    out = []
    for lib in sorted({s.library for s in picks.values() if s.library is not None}):
        users = [s for s in picks.values() if s.library == lib]
        whole = lib not in loaded and all(s.planless is not None for s in users)
        saved = sum(s.planless[3] - s.ms for s in users if s.planless is not None)
        switch = whole and saved <= margin * total and (
            payback <= 0 or saved * payback <= LIBRARY_START_MS.get(lib, PLAN_MS))
        if switch:
            for s in users:
                _, kernel, tactic, ms = s.planless
                s.runner_up = (label(s.kernel, s.tactic), s.ms)
                s.kernel, s.tactic, s.ms = kernel, tactic, ms
                s.library, s.plan_free, s.planless = None, True, None
        out.append((lib, len(users), saved, switch))
    return out


def _bind(fn, call, inputs):
    return lambda: fn(call, *inputs)


def _reference(op, call: Call, inputs):
    v = vendor_kernel(op)
    return None if v is None else v.fn(dataclasses.replace(call, cache={}), *inputs)


# ---------------------------------------------------------------- the clock


def cuda_timer(target_ms: float = 2.0, reps: int = 5, max_calls: int = 100,
               cuda_graph: bool = True) -> GraphTimer:
    """``timer(fn) -> ms`` (with ``timer.estimate``): see :class:`GraphTimer`."""
    return GraphTimer(target_ms, reps, max_calls, cuda_graph)


class GraphTimer:
    """Times a candidate as the engine runs it: ``n`` calls captured in one CUDA graph and
    replayed ``reps`` times, the median replay divided by ``n``, with ``n`` chosen so that a
    replay takes about ``target_ms`` (at most ``max_calls``). A graph measures GPU time alone;
    a small kernel's Python launch cost (15-100 us) would otherwise decide the pick. A
    candidate that cannot be captured is timed by CUDA events around plain calls.

    ``estimate(fn)``: the same with two calls and one replay, the first pass of
    :func:`select`. Per candidate this costs a few milliseconds beyond the kernel's compile
    (Triton's ``do_bench_cudagraph``, used before, captured ``rep / t`` calls and replayed
    them ten times: about half a second per candidate, minutes per model)."""

    def __init__(self, target_ms: float = 2.0, reps: int = 5, max_calls: int = 100,
                 cuda_graph: bool = True):
        self.target_ms, self.reps, self.max_calls = target_ms, reps, max_calls
        self.cuda_graph = cuda_graph
        self._stream = None

    def __call__(self, fn) -> float:
        return self._time(fn, quick=False)

    def estimate(self, fn) -> float:
        return self._time(fn, quick=True)

    def _time(self, fn, quick: bool) -> float:
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # one timing stream: one cuBLAS workspace
        self._stream.wait_stream(torch.cuda.current_stream())  # the inputs are ready
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            fn()  # compiles, plans, allocates: outside every measurement
            self._stream.synchronize()
            if self.cuda_graph:
                try:
                    if quick:
                        return self._graph(fn, 2, 1)
                    est = self._graph(fn, 2, 1)
                    n = int(min(self.max_calls, max(1, self.target_ms / max(est, 1e-4))))
                    return self._graph(fn, n, self.reps)
                except Exception:  # not capturable: a host sync, a CPU tensor...
                    torch.cuda.synchronize()
            return self._events(fn, 2 if quick else 10, 1 if quick else self.reps)

    def _graph(self, fn, calls: int, reps: int) -> float:
        # capture_begin/end rather than ``torch.cuda.graph``, whose entry runs gc.collect()
        # and empty_cache(): tens of milliseconds per capture in a process holding a model
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        try:
            for _ in range(calls):
                fn()
        except BaseException:
            try:
                g.capture_end()
            except RuntimeError:
                pass
            raise
        g.capture_end()
        g.replay()  # first replay uploads the graph
        out = [self._replay_ms(g.replay) / calls for _ in range(reps)]
        g.reset()
        return statistics.median(out)

    def _events(self, fn, calls: int, reps: int) -> float:
        def run():
            for _ in range(calls):
                fn()
        run()
        return statistics.median(self._replay_ms(run) / calls for _ in range(reps))

    def _replay_ms(self, run) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(self._stream)
        run()
        b.record(self._stream)
        b.synchronize()
        return a.elapsed_time(b)


# ---------------------------------------------------------------- a whole graph


def tune_graph(graph, profile=None, cache: TimingCache | None = None,
               timer: Callable | None = None, log: Callable[[str], None] = lambda m: None,
               device: str = "cuda", plan_margin: float = 0.0,
               status: dict | None = None, plan_payback: int = 0,
               keep: Callable[[str, Candidate, object], bool] | None = None
               ) -> dict[str, Selection]:
    """Run ``graph`` once at the profile's opt shapes with the PyTorch kernels on ``device``;
    at every node that has CUDA kernels, time its candidates on the live inputs first
    (``plan_margin``, ``plan_payback``: see :func:`select`).

    Returns a :class:`Selection` per tuned node (nodes with only the PyTorch kernel are not
    listed). Saves ``cache`` at the end. ``status["complete"]``: whether the run on random
    inputs reached the end (random indices out of range stop it before a CUDA kernel would
    assert and take the process's CUDA context with it). ``keep(node_name, candidate, attrs)``:
    only the candidates it accepts are run, each once even where one is left, and a node left
    with none runs its PyTorch kernel untimed (:mod:`kiln.builder.precompile`'s workers, which
    split the candidates between them)."""
    import kiln.kernels.triton  # noqa: F401  (registers the CUDA kernels)
    from kiln.engine.engine import TensorInfo
    from kiln.engine.executor import Executor
    from kiln.engine.inputs import tuning_inputs
    from kiln.kernels.torch.convert import to_torch

    timer = timer or cuda_timer()
    picks: dict[str, Selection] = {}
    if status is not None:
        status["complete"] = False
    if not any(kernels_for(n.op, "cuda") for n in _nodes(graph)):
        return picks  # nothing to choose between: every layer runs its PyTorch kernel

    def choose(node, backend):
        torch_k = vendor_kernel(node.op)
        if torch_k is None:
            raise KilnError(f"node '{node.name}': op {node.op.qualname} has no kernel")
        if not kernels_for(node.op, "cuda"):
            return _on_device(_index_checked(torch_k), device)

        def tuned(call, *ins):
            ins = tuple(_to(x, device) for x in ins)
            if node.name not in picks:
                cands = candidates(node.op, call, ins)
                if keep is not None:
                    cands = [c for c in cands if keep(node.name, c, call.attrs)]
                if len(cands) > (0 if keep is not None else 1):
                    picks[node.name] = sel = select(node.name, node.op, call, ins, cands,
                                                    timer, cache, plan_margin=plan_margin,
                                                    plan_payback=plan_payback)
                    log("autotune " + sel.line())
            return torch_k.fn(call, *ins)
        return dataclasses.replace(torch_k, fn=tuned)

    try:
        # zero integers: random token ids past a small table (a BERT's two token types)
        # stopped the run at the first embedding, and every layer after it went untuned
        args = tuning_inputs([TensorInfo.of(v) for v in graph.inputs], profile=profile)
        ex = Executor(graph, "cuda", choose)
        ex.run([_to(to_torch(args[v.name]), device) for v in graph.inputs])
        if status is not None:
            status["complete"] = True
    except KilnError as e:  # random data the model cannot take (an index, a k, a shape)
        log(f"autotune: the tuning run stopped on random inputs ({e}); the layers it did "
            "not reach keep their default kernel")
    if cache is not None:
        cache.save()
    if device == "cuda" and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        # the timing streams' cuBLAS workspaces (~33 MiB each) would outlive the build
        torch._C._cuda_clearCublasWorkspaces()
    return picks


def _nodes(graph):
    for n in graph.nodes:
        yield n
        for g in n.subgraphs():
            yield from _nodes(g)


def _index_range(op, call, x) -> tuple[int, int] | None:
    """The [lo, hi) an index input of ``op`` must stay in, or None for ops without one."""
    from kiln.ops import reduce as R
    from kiln.ops import tensor as T

    if op in (T.Gather, T.GatherElements):
        n = x.shape[call.attrs.axis % x.dim()] if x.dim() else 0
        return -n, n
    if op in (R.NegativeLogLikelihoodLoss, R.SoftmaxCrossEntropyLoss):
        return 0, x.shape[1] if x.dim() > 1 else 0  # class indices (ignore_index aside)
    return None


def _index_checked(k: Kernel) -> Kernel:
    """A Gather, GatherElements or loss whose random indices fall outside the data raises a
    KilnError (the tuning run stops there) instead of a device-side assert, which no process
    survives."""
    from kiln.ops import reduce as R
    from kiln.ops import tensor as T

    if k.op not in (T.Gather, T.GatherElements, R.NegativeLogLikelihoodLoss,
                    R.SoftmaxCrossEntropyLoss):
        return k

    def fn(call, x, idx, *rest, _f=k.fn):
        rng = _index_range(k.op, call, x)
        if rng is not None and isinstance(idx, torch.Tensor) and idx.numel():
            ignore = getattr(call.attrs, "ignore_index", None)
            bad = (idx < rng[0]) | (idx >= rng[1])
            if ignore is not None:
                bad &= idx != ignore
            if bool(bad.any()):
                raise KilnError(f"node '{call.node_name}': random indices outside "
                                f"[{rng[0]}, {rng[1]})")
        return _f(call, x, idx, *rest)
    return dataclasses.replace(k, fn=fn)


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) and x.device.type != device else x


def _on_device(k: Kernel, device: str) -> Kernel:
    return dataclasses.replace(k, fn=lambda call, *ins, _f=k.fn: _f(
        call, *(_to(x, device) for x in ins)))
