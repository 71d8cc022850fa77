"""The scheduler with stand-in instances: batches stacked and split, one answer per request,
queue full and timeouts answered with the right errors, close() drains."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kiln.serve.config import BatchPolicy
from kiln.serve.errors import Kind, ServeError
from kiln.serve.scheduler import Scheduler


class Gate:
    """An instance whose runs wait for the test to open a gate; records each batch."""

    def __init__(self):
        self.batches: list[int] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def run(self, feeds):
        self.batches.append(feeds["x"].shape[0])
        self.started.set()
        self.gate.wait(30)
        return {"y": feeds["x"] * 2}


def feeds(i: int, rows: int = 1) -> dict:
    return {"x": np.full((rows, 3), i, np.float32)}


async def wait_thread(event: threading.Event):
    assert await asyncio.to_thread(event.wait, 30)


def test_scheduler_second_wave_batches_while_first_runs():
    async def main():
        inst = Gate()
        s = Scheduler(BatchPolicy(max_batch_size=16, dynamic=True, max_delay=0.0), [inst])
        s.start()
        first = asyncio.ensure_future(s.submit(feeds(0), 1, "k"))
        await wait_thread(inst.started)  # the first request runs alone ...
        rest = [asyncio.ensure_future(s.submit(feeds(i), 1, "k")) for i in range(1, 12)]
        await asyncio.sleep(0.05)
        inst.gate.set()  # ... and the 11 that came meanwhile go together
        outs = await asyncio.gather(first, *rest)
        await s.close()
        return inst.batches, outs

    batches, outs = asyncio.run(main())
    assert batches == [1, 11]
    for i, (out, timing) in enumerate(outs):
        np.testing.assert_array_equal(out["y"], np.full((1, 3), 2 * i, np.float32))
        assert timing.batch == (1 if i == 0 else 11)


def test_scheduler_queue_full_is_unavailable():
    async def main():
        inst = Gate()
        policy = BatchPolicy(max_batch_size=4, dynamic=True, max_queue_size=2)
        s = Scheduler(policy, [inst])
        s.start()
        running = asyncio.ensure_future(s.submit(feeds(0), 1, "k"))
        await wait_thread(inst.started)
        queued = [asyncio.ensure_future(s.submit(feeds(i), 1, "k")) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(ServeError) as e:
            await s.submit(feeds(3), 1, "k")
        inst.gate.set()
        await asyncio.gather(running, *queued)
        await s.close()
        return e.value

    err = asyncio.run(main())
    assert err.kind is Kind.UNAVAILABLE and "maximum of 2" in err.message


def test_scheduler_queue_timeout_answers_timeout():
    async def main():
        inst = Gate()
        s = Scheduler(BatchPolicy(max_batch_size=4, dynamic=True), [inst])
        s.start()
        running = asyncio.ensure_future(s.submit(feeds(0), 1, "k"))
        await wait_thread(inst.started)
        with pytest.raises(ServeError) as e:
            await s.submit(feeds(1), 1, "k", timeout=0.05)  # waits behind the running one
        inst.gate.set()
        await running
        await s.close()
        return e.value

    assert asyncio.run(main()).kind is Kind.TIMEOUT


def test_scheduler_engine_error_fails_the_batch_only():
    class Failing:
        def run(self, feeds):
            if feeds["x"][0, 0] < 0:
                raise RuntimeError("negative")
            return {"y": feeds["x"]}

    async def main():
        s = Scheduler(BatchPolicy(max_batch_size=0), [Failing()])
        s.start()
        bad = await asyncio.gather(s.submit(feeds(-1), 1, "k"), return_exceptions=True)
        good = await s.submit(feeds(1), 1, "k")
        await s.close()
        return bad[0], good

    bad, good = asyncio.run(main())
    assert isinstance(bad, ServeError) and bad.kind is Kind.INTERNAL and "negative" in bad.message
    assert good[0]["y"][0, 0] == 1


def test_scheduler_close_drains_queued_requests():
    async def main():
        inst = Gate()
        s = Scheduler(BatchPolicy(max_batch_size=2, dynamic=True), [inst])
        s.start()
        jobs = [asyncio.ensure_future(s.submit(feeds(i), 1, "k")) for i in range(5)]
        await wait_thread(inst.started)
        closing = asyncio.ensure_future(s.close())
        await asyncio.sleep(0.02)
        with pytest.raises(ServeError):  # closing: new requests are refused ...
            await s.submit(feeds(9), 1, "k")
        inst.gate.set()
        outs = await asyncio.gather(*jobs)  # ... queued ones are all answered
        await closing
        return outs

    assert len(asyncio.run(main())) == 5
