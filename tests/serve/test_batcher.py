"""The dynamic batcher as a pure policy, on a fake clock (the shape of Triton's batcher QA)."""

from __future__ import annotations

import heapq
import random

import pytest

from kiln.serve.batcher import Batcher, Pending, QueueFull
from kiln.serve.config import BatchPolicy


def simulate(policy: BatchPolicy, arrivals, exec_time: float, instances: int = 1):
    """Drive the batcher as the scheduler does, on a fake clock: requests arrive at the given
    times; each execution takes ``exec_time``. Returns the batches (lists of request ids) in
    execution order and the expired ids."""
    b = Batcher(policy)
    events = [(t, 0, i) for i, t in enumerate(arrivals)]  # (time, kind 0=arrive 1=done, id)
    heapq.heapify(events)
    free, batches, expired, reqs = instances, [], [], {}
    now = 0.0
    while events or len(b):
        nxt = [events[0][0]] if events else []
        wake = b.wake_time(now, free=free > 0)
        if wake is not None:
            nxt.append(max(wake, now))
        now = min(nxt)
        while events and events[0][0] <= now:
            _, kind, i = heapq.heappop(events)
            if kind == 0:
                reqs[i] = Pending(1, "k", now, payload=i)
                b.add(reqs[i])
            else:
                free += 1
        expired += [r.payload for r in b.expire(now)]
        while free and (batch := b.next_batch(now)) is not None:
            free -= 1
            batches.append([r.payload for r in batch])
            heapq.heappush(events, (now + exec_time, 1, -1))
        if not events and not free and len(b):
            break  # cannot happen: a running batch always leaves a 'done' event
    return batches, expired


def test_batcher_delay0_twelve_requests_two_executions():
    # Triton's QA: 12 batch-1 requests, no queue delay, a model taking 100 ms -> the first
    # runs alone at once, the other 11 gather while it runs and go as one batch
    policy = BatchPolicy(max_batch_size=16, dynamic=True, max_delay=0.0)
    batches, _ = simulate(policy, [i * 0.001 for i in range(12)], exec_time=0.1)
    assert [len(x) for x in batches] == [1, 11]
    assert sorted(sum(batches, [])) == list(range(12))


def test_batcher_delay_gathers_until_max_batch():
    policy = BatchPolicy(max_batch_size=4, dynamic=True, max_delay=0.05)
    batches, _ = simulate(policy, [0.0] * 10, exec_time=0.01, instances=3)
    assert [len(x) for x in batches] == [4, 4, 2]


def test_batcher_preferred_size_goes_before_delay():
    b = Batcher(BatchPolicy(max_batch_size=8, dynamic=True, preferred=(2, 4), max_delay=1.0))
    for i in range(5):
        b.add(Pending(1, "k", 0.0, payload=i))
    batch = b.next_batch(0.0)
    assert [r.payload for r in batch] == [0, 1, 2, 3]  # the largest preferred size reached
    assert b.next_batch(0.5) is None  # one left: below every preferred size, delay not over
    assert b.wake_time(0.5) == pytest.approx(1.0)
    assert [r.payload for r in b.next_batch(1.0)] == [4]


def test_batcher_waits_for_delay_without_preferred_size():
    b = Batcher(BatchPolicy(max_batch_size=8, dynamic=True, max_delay=0.01))
    b.add(Pending(1, "k", 0.0))
    b.add(Pending(1, "k", 0.004))
    assert b.next_batch(0.009) is None
    assert len(b.next_batch(0.010)) == 2


def test_batcher_rows_of_multi_row_requests_count():
    b = Batcher(BatchPolicy(max_batch_size=8, dynamic=True, max_delay=0.0))
    for rows in (3, 4, 2):
        b.add(Pending(rows, "k", 0.0))
    assert [r.rows for r in b.next_batch(0.0)] == [3, 4]  # 3+4+2 > 8: the third waits
    assert [r.rows for r in b.next_batch(0.0)] == [2]


def test_no_batch_incompatible_shapes():
    b = Batcher(BatchPolicy(max_batch_size=8, dynamic=True, max_delay=1.0))
    for i, key in enumerate(["a", "a", "b", "a"]):
        b.add(Pending(1, key, 0.0, payload=i))
    assert [r.payload for r in b.next_batch(0.0)] == [0, 1]  # closed by the 'b' request
    assert [r.payload for r in b.next_batch(0.0)] == [2]
    assert b.next_batch(0.0) is None  # the last 'a' waits for its delay
    assert [r.payload for r in b.next_batch(1.0)] == [3]


def test_batcher_queue_full_refuses_at_once():
    b = Batcher(BatchPolicy(max_batch_size=4, dynamic=True, max_queue_size=2))
    b.add(Pending(1, "k", 0.0))
    b.add(Pending(1, "k", 0.0))
    with pytest.raises(QueueFull, match="maximum of 2"):
        b.add(Pending(1, "k", 0.0))
    b.next_batch(0.0)
    b.add(Pending(1, "k", 0.0))  # room again once the queue moved


def test_batcher_timeouts_expire_and_wake():
    b = Batcher(BatchPolicy(max_batch_size=4, dynamic=True, max_delay=10.0))
    b.add(Pending(1, "k", 0.0, deadline=0.5, payload="short"))
    b.add(Pending(1, "k", 0.0, deadline=None, payload="long"))
    assert b.wake_time(0.0) == 0.5
    assert b.expire(0.4) == []
    assert [r.payload for r in b.expire(0.5)] == ["short"]
    assert [r.payload for r in b.next_batch(10.0)] == ["long"]


def test_batcher_without_dynamic_batching_runs_each_alone():
    b = Batcher(BatchPolicy(max_batch_size=8, dynamic=False))
    for _ in range(3):
        b.add(Pending(1, "k", 0.0))
    assert [len(b.next_batch(0.0)) for _ in range(3)] == [1, 1, 1]
    assert b.wake_time(0.0) is None


def test_batcher_every_request_answered_exactly_once():
    rng = random.Random(0)
    policy = BatchPolicy(max_batch_size=6, dynamic=True, preferred=(3, 6), max_delay=0.003)
    b = Batcher(policy)
    answered: list[int] = []
    now, n = 0.0, 500
    for i in range(n):
        now += rng.expovariate(2000)
        b.add(Pending(rng.choice([1, 2]), rng.choice("ab"), now,
                      deadline=now + rng.choice([0.002, 1.0]), payload=i))
        answered += [r.payload for r in b.expire(now)]
        if rng.random() < 0.5 and (batch := b.next_batch(now)) is not None:
            assert sum(r.rows for r in batch) <= 6 and len({r.key for r in batch}) == 1
            answered += [r.payload for r in batch]
    while len(b):
        now += 0.01
        answered += [r.payload for r in b.expire(now)]
        answered += [r.payload for r in b.next_batch(now) or []]
    assert sorted(answered) == list(range(n))
