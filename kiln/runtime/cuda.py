"""The CUDA runtime: device fingerprints, host <-> device staging, and CUDA graphs.

:class:`CudaRunner` is the per-:class:`~kiln.engine.ExecutionContext` half of a CUDA engine. It
owns a CUDA stream, pinned staging buffers for inputs and outputs, and one CUDA graph per
concrete input-shape signature:

1. The first run of a signature is eager (it warms cuDNN/cuBLAS up and fills the kernels'
   caches), then the whole launch sequence is captured once into a ``torch.cuda.CUDAGraph``
   with static input and output buffers, replayed once and compared with the eager result.
2. Later runs copy the inputs into the static buffers, replay the graph and copy the outputs
   out: one host call for the whole model.
3. A signature whose capture fails (a host sync such as ``.item()``/``.tolist()`` on a device
   tensor, a data-dependent shape) or whose replay disagrees with eager runs eagerly from then
   on; the decision and its reason are remembered per signature (:attr:`CudaRunner.decisions`).
   Graphs with ops that are data-dependent by nature (:data:`EAGER_OPS`, subgraphs) are never
   captured.

All the graphs of one context share one private memory pool. That is safe because a run
copies its outputs out (or clones them, for device outputs) before the next run replays.
"""

from __future__ import annotations

import contextlib
import platform
import threading
import time

import numpy as np
import torch

from kiln.errors import EngineFileError
from kiln.kernels.torch.convert import to_numpy, to_torch
from kiln.ops import control, tensor, text_ml, vision
from kiln.settings import SETTINGS

# ops whose output shape (or control flow) depends on data: never captured
EAGER_OPS = frozenset({tensor.NonZero, tensor.Unique, tensor.Compress, control.If, control.Loop,
                       control.Scan, vision.NonMaxSuppression, text_ml.StringNormalizer,
                       text_ml.TfIdfVectorizer})
MAX_GRAPHS = 32  # captured shape signatures per context; further shapes run eagerly
_CAPTURE_LOCK = threading.Lock()  # one capture at a time in the process


# ---- what an engine was built on

def fingerprint(kind: str) -> dict:
    """The device an engine is built for, as recorded in its header."""
    if kind == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"kind": "cuda", "name": p.name, "capability": [p.major, p.minor],
                "cuda_version": torch.version.cuda, "torch_version": torch.__version__,
                "triton_version": triton_version()}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(),
            "capability": None}


def triton_version() -> str | None:
    try:
        import importlib.metadata as md
        return md.version("triton")
    except Exception:
        return None


_CHECKED = ("name", "capability", "cuda_version", "torch_version", "triton_version")


def check_device(built: dict, path, portable: bool = False) -> list[str]:
    """Refuse a CUDA engine built for another GPU model or other CUDA/torch/triton versions.

    Returns the differences (empty when it matches); with ``portable`` they are accepted (and
    returned, for the caller to report), and kernels are tuned again on first use."""
    if built.get("kind") != "cuda":
        return []
    if not torch.cuda.is_available():
        raise EngineFileError(
            f"'{path}' was built for CUDA ({built.get('name')}), and this machine has no CUDA "
            "device; rebuild it here with `kiln build --device cpu`")
    here = fingerprint("cuda")
    diffs = [f"{k.replace('_', ' ')}: built with {built.get(k)!r}, here {here.get(k)!r}"
             for k in _CHECKED if k in built and built.get(k) != here.get(k)]
    if diffs and not portable:
        raise EngineFileError(
            f"'{path}' was built on a {built.get('name')} and this machine has a "
            f"{here['name']}; they differ in " + "; ".join(diffs) + ". Rebuild the engine "
            "here with `kiln build --device cuda`, or load it with "
            "kiln.load(path, portable=True) to run it anyway (kernels are re-tuned on first "
            "use, and speed may differ from the build machine's)")
    return diffs


# ---- build/run-time switches

@contextlib.contextmanager
def math_flags(tf32: bool):
    """cuDNN on (autotuning only with KILN_CUDNN_BENCHMARK=1), TF32 as the build allowed, for
    the duration of a run."""
    mm = torch.backends.cuda.matmul
    old = mm.allow_tf32
    mm.allow_tf32 = tf32
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=SETTINGS.cudnn_benchmark,
                                        allow_tf32=tf32):
            yield
    finally:
        mm.allow_tf32 = old


def never_captured(executor) -> str | None:
    """Why ``executor``'s graph can never be captured, or None."""
    for st in executor.steps:
        if st.node.op in EAGER_OPS or st.node.subgraphs():
            return f"node '{st.node.name}' ({st.node.op.name}) has data-dependent shapes"
    return None


class _Captured:
    __slots__ = ("graph", "inputs", "outputs", "keep")

    def __init__(self, graph, inputs, outputs, keep):
        self.graph, self.inputs, self.outputs, self.keep = graph, inputs, outputs, keep


class CudaRunner:
    """Runs one context's requests on the device (see the module docstring)."""

    def __init__(self, executor, device: torch.device, cuda_graph: bool = True,
                 tf32: bool = True):
        self.ex, self.device, self.tf32 = executor, device, tf32
        self.stream = torch.cuda.Stream(device)
        self.never = never_captured(executor) if cuda_graph else "CUDA graphs are off"
        self.graphs: dict[tuple, _Captured | None] = {}  # (executor id, signature) -> graph
        self.decisions: dict[tuple, str] = {}  # signature -> "cuda graph" or why eager
        self.pool = None
        self._in_stage: dict[int, torch.Tensor] = {}
        self._out_stage: dict[int, torch.Tensor] = {}
        self._h2d_done: torch.cuda.Event | None = None
        self.record_timing = False  # set to fill last_timing (kiln bench)
        self.last_timing: dict | None = None
        self._enqueue_s = 0.0

    # ---- one run

    def run(self, args: list, to_torch_out: bool, out_device: torch.device | None,
            executor=None, copy_outputs: bool = True) -> list:
        """``args``: one numpy array or torch tensor per input. Returns numpy arrays, or torch
        tensors on ``out_device`` (the caller's) when ``to_torch_out``. ``executor``: the
        engine's executor for the profile the inputs matched (default: the context's).
        ``copy_outputs=False``: torch outputs on the device may be the graph's own output
        buffers, valid until this context's next run (no copy, no second output in memory)."""
        caller = torch.cuda.current_stream(self.device)
        ex = executor if executor is not None else self.ex
        sig = tuple((tuple(a.shape), str(a.dtype).removeprefix("torch.")) for a in args)
        key = (id(ex), sig)  # a shape signature, under the profile's executor
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] \
            if self.record_timing else None
        with torch.cuda.stream(self.stream), math_flags(self.tf32):
            self.stream.wait_stream(caller)  # device inputs the caller just wrote
            if ev:
                ev[0].record()
            entry = self.graphs.get(key)
            replayed = entry is not None
            if key not in self.graphs:
                outs, replayed = self._first_run(ex, key, self._stage_in(args, None), ev)
            elif entry is None:
                outs = self._launch(ex, None, self._stage_in(args, None), ev)
            else:
                self._stage_in(args, entry)
                outs = self._launch(ex, entry, None, ev)
            outs = self._stage_out(outs, to_torch_out, out_device, replayed and copy_outputs,
                                   ev, caller)
        return outs

    def _first_run(self, ex, key: tuple, dev: list, ev) -> tuple[list, bool]:
        """Eager, then capture and check the replay; returns (outputs, from the graph?).
        The eager outputs are reduced to small probes before the capture, so the first run
        never holds two sets of outputs at once (peak memory stays one run's)."""
        outs = self._launch(ex, None, dev, ev)
        reason = self.never or (f"more than {MAX_GRAPHS} shape signatures captured"
                                if sum(g is not None for g in self.graphs.values()) >= MAX_GRAPHS
                                else None)
        if reason is None and any(not _on_device(a) for a in dev):
            reason = "an input stays on the host (a dtype torch has no CUDA tensor for)"
        entry = None
        if reason is None:
            probes = [_probe(o) for o in outs]
            del outs
            entry, reason = self._capture(ex, dev, probes)
            outs = entry.outputs if entry is not None else self._launch(ex, None, dev, None)
        self.graphs[key] = entry
        self.decisions[key[1]] = "cuda graph" if entry is not None else f"eager: {reason}"
        return outs, entry is not None

    def _launch(self, ex, entry: _Captured | None, dev: list | None, ev) -> list:
        if ev:
            ev[1].record()
        t0 = time.perf_counter()
        if entry is not None:
            entry.graph.replay()
            outs = entry.outputs
        else:
            outs = ex.run(dev)
        if ev:
            self._enqueue_s = time.perf_counter() - t0
            ev[2].record()
        return outs

    # ---- capture

    def _capture(self, ex, dev: list, probes: list) -> tuple[_Captured | None, str | None]:
        static_in = [a.clone() for a in dev]  # outside the pool: never reused by replays
        keep: list = []
        g = torch.cuda.CUDAGraph()
        try:
            with _CAPTURE_LOCK:
                self.stream.synchronize()
                with torch.cuda.graph(g, pool=self.pool, stream=self.stream,
                                      capture_error_mode="thread_local"):
                    static_out = ex.run(static_in, keep=keep)
            if self.pool is None:
                self.pool = g.pool()
            for s, a in zip(static_in, dev):
                s.copy_(a)
            g.replay()
            bad = _first_difference(probes, [_probe(o) for o in static_out])
            if bad is not None:
                return None, f"the replayed graph disagrees with eager execution ({bad})"
            return _Captured(g, static_in, static_out, keep), None
        except Exception as e:  # a host sync, an op that cannot be captured, ...
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            msg = str(e).strip().splitlines()
            return None, f"capture failed: {type(e).__name__}: {msg[0] if msg else ''}"[:300]

    # ---- host <-> device

    def _stage_in(self, args: list, entry: _Captured | None) -> list:
        """Inputs onto the device: through pinned buffers for host data, into the static
        buffers when replaying a graph."""
        if self._h2d_done is not None:
            self._h2d_done.synchronize()  # the last run's copies have read the staging buffers
        out = []
        for k, a in enumerate(args):
            t = a if isinstance(a, torch.Tensor) else to_torch(np.asarray(a))
            if not isinstance(t, torch.Tensor):
                out.append(t)  # strings & co. stay on the host (the graph runs eagerly)
                continue
            if t.device.type == "cpu":
                stage = self._in_stage.get(k)
                if stage is None or stage.shape != t.shape or stage.dtype != t.dtype:
                    stage = self._in_stage[k] = torch.empty(t.shape, dtype=t.dtype,
                                                            pin_memory=True)
                stage.copy_(t)
                t = stage
            if entry is not None:
                entry.inputs[k].copy_(t, non_blocking=True)
            else:
                out.append(t.to(self.device, non_blocking=True))
        self._h2d_done = torch.cuda.Event()
        self._h2d_done.record(self.stream)
        return out

    def _stage_out(self, outs: list, to_torch_out: bool, out_device, replayed: bool, ev,
                   caller) -> list:
        if to_torch_out and out_device is not None and out_device.type == "cuda":
            res = [o.clone() if replayed and isinstance(o, torch.Tensor) else o for o in outs]
            res = [o.to(out_device) if _on_device(o) and o.device != out_device else o
                   for o in res]
            if ev:
                ev[3].record()
            caller.wait_stream(self.stream)
            for o in res:
                if _on_device(o):
                    o.record_stream(caller)
            self._timing(ev)
            return res
        staged = []
        for k, o in enumerate(outs):
            if _on_device(o):
                stage = self._out_stage.get(k)
                if stage is None or stage.shape != o.shape or stage.dtype != o.dtype:
                    stage = self._out_stage[k] = torch.empty(o.shape, dtype=o.dtype,
                                                             pin_memory=True)
                stage.copy_(o, non_blocking=True)
                o = stage
            staged.append(o)
        if ev:
            ev[3].record()
        self.stream.synchronize()
        self._timing(ev)
        if to_torch_out:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in staged]
        return [np.array(to_numpy(o), copy=True) if isinstance(o, torch.Tensor) else
                to_numpy(o) for o in staged]

    def _timing(self, ev) -> None:
        if not ev:
            return
        ev[3].synchronize()
        self.last_timing = {"enqueue_s": self._enqueue_s,
                            "h2d_ms": ev[0].elapsed_time(ev[1]),
                            "compute_ms": ev[1].elapsed_time(ev[2]),
                            "d2h_ms": ev[2].elapsed_time(ev[3])}


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


_PROBE = 1 << 16  # elements of an output kept to check a captured graph against eager


def _probe(x):
    """What a replay is checked against: (shape, dtype, up to _PROBE evenly strided elements,
    on the host); non-tensors as they are."""
    if not isinstance(x, torch.Tensor):
        return x
    flat = x.reshape(-1)
    step = max(1, -(-flat.numel() // _PROBE))
    return (tuple(x.shape), x.dtype, flat[::step].cpu())


def _first_difference(a: list, b: list) -> str | None:
    """Where the replayed outputs' probes ``b`` differ from the eager ones ``a`` (None:
    nowhere)."""
    for k, (x, y) in enumerate(zip(a, b)):
        if not isinstance(x, tuple) or not isinstance(y, tuple):
            continue
        if x[:2] != y[:2]:
            return f"output {k}: {x[0]} {x[1]} vs {y[0]} {y[1]}"
        if x[1].is_floating_point:
            ok = torch.allclose(x[2].float(), y[2].float(), rtol=1e-2, atol=1e-2, equal_nan=True)
        else:
            ok = bool(torch.equal(x[2], y[2]))
        if not ok:
            return f"output {k} differs"
    return None
