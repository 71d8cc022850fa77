"""Where an engine's steps spend their time, part by part (for benchmarks; off by default).

``LLMEngine.set_profile(StepProfile())`` makes every ``step()`` record, on the host clock::

    schedule   Scheduler.schedule (budget, KV blocks, block tables)
    inputs     the runner's host work before the model: token ids, positions, entries
    launch     the model call up to the wait for its result: step tensors (meta, the decode
               buffer fill and copy), kernel launches or the graph replay
    sync       waiting for the device and turning the sampled ids into Python ints
    update     Scheduler.update_from_output (KV bookkeeping, prefix hashes, stop checks)
    emit       detokenizing and the StepOutputs
    metrics    EngineMetrics.on_step

and, with ``cuda=True``, ``device``: CUDA-event time from the model call's start to its last
kernel (read after the step's own sync, so it costs no extra wait). ``launch + sync`` is the
runner's wall time; ``device`` near it means the GPU was busy all along (the host kept up),
well below it means the GPU waited for the host.
"""

from __future__ import annotations

import statistics
import time

PARTS = ("schedule", "inputs", "launch", "sync", "update", "emit", "metrics")


class StepProfile:
    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.steps: list[dict] = []  # per step: part -> seconds, plus tokens / seqs / device
        self._cur: dict | None = None
        self._t = 0.0
        self._events = None

    def begin(self):
        self._cur = {}
        self._t = time.perf_counter()
        self._events = None

    def mark(self, part: str):
        """The time since the last mark (or ``begin``) goes to ``part``."""
        if self._cur is None:
            return
        t = time.perf_counter()
        self._cur[part] = self._cur.get(part, 0.0) + t - self._t
        self._t = t

    def device_start(self):
        if self.cuda and self._cur is not None:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events = [ev, None]

    def device_end(self):
        if self._events is not None and self._events[1] is None:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[1] = ev

    def end(self, **info):
        """Close the step (``info``: tokens, seqs, ...); the device span is read here."""
        if self._cur is None:
            return
        ev = self._events
        if ev is not None and ev[1] is not None:
            ev[1].synchronize()
            self._cur["device"] = ev[0].elapsed_time(ev[1]) / 1e3
        self._cur.update(info)
        self.steps.append(self._cur)
        self._cur = self._events = None

    def summary(self, steps: list[dict] | None = None) -> dict:
        """Over ``steps`` (default all): per part the total seconds and the median step's
        milliseconds, the steps' wall total (the parts' sum) and tokens."""
        steps = self.steps if steps is None else steps
        if not steps:
            return {}
        out = {"steps": len(steps), "tokens": sum(s.get("tokens", 0) for s in steps)}
        parts = [p for p in (*PARTS, "device") if any(p in s for s in steps)]
        walls = [sum(s.get(p, 0.0) for p in PARTS) for s in steps]
        out["wall_s"] = sum(walls)
        out["wall_ms_median"] = statistics.median(walls) * 1e3
        out["total_s"] = {p: sum(s.get(p, 0.0) for s in steps) for p in parts}
        out["median_ms"] = {p: statistics.median(s.get(p, 0.0) for s in steps) * 1e3
                            for p in parts}
        host = ("schedule", "inputs", "update", "emit", "metrics")
        out["host_s"] = sum(out["total_s"].get(p, 0.0) for p in host)
        out["runner_s"] = sum(out["total_s"].get(p, 0.0) for p in ("launch", "sync"))
        return out
