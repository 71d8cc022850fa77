"""The dynamic batcher as a pure policy: it holds the queue and decides which requests run
together and when, given the time; it runs nothing and reads no clock, so a test drives it with
a fake one (as vLLM's scheduler is separated from its executor).

    add(request)            queue a request, or raise QueueFull at once
    expire(now)             requests whose queue deadline passed (answer each with an error)
    next_batch(now)         the requests to run on a free instance now, or None to wait
    wake_time(now, free)    when calling next_batch/expire again can change the answer

Rules (Triton's dynamic batcher): requests run in arrival order; a batch holds requests whose
shapes match (same key) up to ``max_batch_size`` rows; it is sent at once when it is full, when
the next request cannot join it, or when it reaches a preferred size (the largest one reachable
from the head of the queue); otherwise it waits until the oldest request has waited
``max_delay``, then goes as it is. Without dynamic batching every request runs alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kiln.serve.config import BatchPolicy


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Pending:
    """One queued request: ``rows`` it adds to a batch, the ``key`` requests must share to run
    together (their shapes past the batch dim and dtypes), when it arrived, its deadline."""

    rows: int
    key: Hashable
    arrived: float
    deadline: float | None = None
    payload: Any = field(default=None, repr=False)


class Batcher:
    def __init__(self, policy: BatchPolicy):
        self.policy = policy
        self.queue: deque[Pending] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, req: Pending) -> None:
        limit = self.policy.max_queue_size
        if limit and len(self.queue) >= limit:
            raise QueueFull(f"the queue holds its maximum of {limit} requests")
        self.queue.append(req)

    def expire(self, now: float) -> list[Pending]:
        if not any(r.deadline is not None and r.deadline <= now for r in self.queue):
            return []
        gone = [r for r in self.queue if r.deadline is not None and r.deadline <= now]
        self.queue = deque(r for r in self.queue if r not in gone)
        return gone

    def next_batch(self, now: float) -> list[Pending] | None:
        if not self.queue:
            return None
        p = self.policy
        if not p.dynamic:
            return [self.queue.popleft()]
        run, closed = self._head_run()
        rows = [0]
        for r in run:
            rows.append(rows[-1] + r.rows)
        total = rows[-1]
        # a preferred size reached from the head: the largest one goes now
        hits = [i for i in range(1, len(run) + 1) if rows[i] in p.preferred]
        if closed or total >= p.max_batch_size:
            n = len(run)
        elif hits:
            n = hits[-1]
        elif now - run[0].arrived >= p.max_delay:
            n = len(run)
        else:
            return None
        return [self.queue.popleft() for _ in range(n)]

    def _head_run(self) -> tuple[list[Pending], bool]:
        """The requests from the head that fit one batch, and whether the batch is closed (the
        next request cannot join it)."""
        head = self.queue[0]
        run, total = [head], head.rows
        for r in list(self.queue)[1:]:
            if r.key != head.key or total + r.rows > self.policy.max_batch_size:
                return run, True
            run.append(r)
            total += r.rows
        return run, False

    def wake_time(self, now: float, free: bool = True) -> float | None:
        """``free``: an instance is free (else only deadlines can change anything)."""
        times = [r.deadline for r in self.queue if r.deadline is not None]
        if free and self.queue and self.policy.dynamic:
            times.append(self.queue[0].arrived + self.policy.max_delay)
        return min(times) if times else None
