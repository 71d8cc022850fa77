"""The scheduler of one model version: drives its :class:`Batcher` with the real clock on the
event loop and runs each batch on a free instance (an :class:`kiln.ExecutionContext`) in a
thread pool, so inference never blocks the loop. Every submitted request gets exactly one
answer: its outputs, or a :class:`ServeError`."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kiln.serve.batcher import Batcher, Pending, QueueFull
from kiln.serve.config import BatchPolicy
from kiln.serve.errors import Kind, ServeError


@dataclass
class Timing:
    """Where one request's time went, in seconds (filled by the scheduler)."""

    queue: float = 0.0
    compute: float = 0.0
    batch: int = 0


@dataclass
class Stats:
    """Counts kept for the statistics extension (``/v2/models/m/stats``)."""

    success: int = 0
    fail: int = 0
    inferences: int = 0
    executions: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    success_ns: int = 0
    last_inference_ms: int = 0
    batches: dict[int, list[int]] = field(default_factory=dict)  # size -> [count, ns]


class Scheduler:
    """Runs requests of one model version. ``instances``: objects with ``run(feeds) ->
    outputs`` (execution contexts), used by one batch at a time each."""

    def __init__(self, policy: BatchPolicy, instances: list, observer=None,
                 clock=time.perf_counter):
        self.batcher = Batcher(policy)
        self.policy = policy
        self.free = list(instances)
        self.count = len(instances)
        self.pool = ThreadPoolExecutor(max_workers=len(instances), thread_name_prefix="kiln-inf")
        self.clock = clock
        self.observer = observer  # called with (batch_size, [Timing]) after each execution
        self.stats = Stats()
        self._wake = asyncio.Event()
        self._closing = False
        self._running = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    @property
    def pending(self) -> int:
        return len(self.batcher) + self._running

    async def submit(self, feeds: dict, rows: int, key, timeout: float | None = None) -> tuple:
        """Queue one request; returns ``(outputs, Timing)`` or raises :class:`ServeError`."""
        return await self.enqueue(feeds, rows, key, timeout)

    def enqueue(self, feeds: dict, rows: int, key, timeout: float | None = None):
        """Queue one request now (a full queue raises :class:`ServeError` at once); the
        future it returns gets ``(outputs, Timing)`` or the request's error."""
        if self._closing:
            raise ServeError(Kind.UNAVAILABLE, "the model version is unloading")
        now = self.clock()
        t = timeout if timeout else self.policy.default_timeout
        fut = asyncio.get_running_loop().create_future()
        req = Pending(rows, key, now, now + t if t else None, payload=(feeds, fut))
        try:
            self.batcher.add(req)
        except QueueFull as e:
            raise ServeError(Kind.UNAVAILABLE, f"request rejected: {e}; retry later") from None
        self._wake.set()
        return fut

    async def close(self) -> None:
        """Stop taking requests, answer every queued and running one, then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self.pool.shutdown(wait=True)

    async def _loop(self) -> None:
        while not (self._closing and not len(self.batcher) and self._running == 0):
            now = self.clock()
            for r in self.batcher.expire(now):
                _answer(r, error=ServeError(Kind.TIMEOUT, "request timed out in the queue "
                                            f"after {now - r.arrived:.3f} s"))
            while self.free:
                batch = self.batcher.next_batch(now)
                if batch is None:
                    break
                self._running += 1
                asyncio.get_running_loop().create_task(self._execute(self.free.pop(), batch))
            wake = self.batcher.wake_time(now, free=bool(self.free))
            self._wake.clear()
            delay = None if wake is None else max(0.0, wake - now)
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _execute(self, instance, batch: list[Pending]) -> None:
        start = self.clock()
        try:
            outs = await asyncio.get_running_loop().run_in_executor(
                self.pool, _run_batch, instance, [r.payload[0] for r in batch])
            error = None
        except ServeError as e:
            outs, error = None, e
        except Exception as e:  # the engine refused the inputs or failed: the batch fails
            kind = Kind.INVALID if type(e).__name__ == "ShapeError" else Kind.INTERNAL
            outs, error = None, ServeError(kind, f"inference failed: {e}")
        end = self.clock()
        self.free.append(instance)
        self._running -= 1
        timings = [Timing(start - r.arrived, end - start, len(batch)) for r in batch]
        self._record(batch, timings, start, end, error is None)
        for i, (r, t) in enumerate(zip(batch, timings)):
            _answer(r, error=error, result=None if error else (outs[i], t))
        self._wake.set()

    def _record(self, batch, timings, start, end, ok: bool) -> None:
        s = self.stats
        rows = sum(r.rows for r in batch)
        s.executions += 1
        s.inferences += rows
        ns = int((end - start) * 1e9)
        s.compute_ns += ns * len(batch)
        s.queue_ns += sum(int(t.queue * 1e9) for t in timings)
        c = s.batches.setdefault(rows, [0, 0])
        c[0] += 1
        c[1] += ns
        s.last_inference_ms = int(time.time() * 1e3)
        if ok:
            s.success += len(batch)
            s.success_ns += sum(int((t.queue + t.compute) * 1e9) for t in timings)
        else:
            s.fail += len(batch)
        if self.observer is not None:
            self.observer(rows, timings, ok)


def _answer(req: Pending, error=None, result=None) -> None:
    fut = req.payload[1]
    if fut.done():  # the client gave up (request timeout, disconnect): nobody to answer
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _run_batch(instance, feeds: list[dict]) -> list[dict]:
    """Runs in a pool thread: stack the requests' inputs along the batch dim, run once, split
    the outputs back into one dict per request."""
    if len(feeds) == 1:
        return [instance.run(feeds[0])]
    rows = [next(iter(f.values())).shape[0] for f in feeds]
    stacked = {n: np.concatenate([f[n] for f in feeds]) for n in feeds[0]}
    outs = instance.run(stacked)
    cuts = np.cumsum(rows)[:-1]
    split = {n: np.split(np.asarray(v), cuts) for n, v in outs.items()}
    return [{n: split[n][i] for n in outs} for i in range(len(feeds))]
