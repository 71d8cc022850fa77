"""An ``LLMEngine`` driven by a background thread, for servers: ``async for out in generate(...)``.

The thread steps the engine while any request is unfinished and sleeps otherwise; each request's
outputs reach its coroutine through an ``asyncio.Queue`` (handed over with
``call_soon_threadsafe``). Adding and aborting take the engine's lock, so errors such as a prompt
that can never fit are raised to the caller at once.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from kiln.llm.engine import LLMEngine, StepOutput
from kiln.llm.sampling import SamplingParams


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="kiln-llm-engine", daemon=True)
        self.thread.start()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _loop(self):
        while not self._stop:
            with self.lock:
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        outs = self.engine.step()
                    except BaseException as e:  # fail every request in flight, keep serving
                        self._fail_all(e)
                        outs = []
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            for out in outs:
                self._deliver(out.request_id, out)

    def _deliver(self, rid: str, item):
        entry = self.queues.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, e: BaseException):
        self.error = e
        for rid in list(self.queues):
            self.engine.abort(rid)
            self._deliver(rid, e)

    def add(self, prompt, params: SamplingParams, request_id: str | None = None):
        """Queue a request; returns (request, queue of StepOutput). Raises on bad input."""
        rid = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = (asyncio.get_running_loop(), q)
        try:
            with self.lock:
                req = self.engine.add_request(prompt, params, rid)
        except BaseException:
            self.queues.pop(rid, None)
            raise
        self.wake.set()
        return req, q

    def abort(self, rid: str):
        self.queues.pop(rid, None)
        with self.lock:
            self.engine.abort(rid)

    async def stream(self, rid: str, q: asyncio.Queue):
        """The StepOutputs of request ``rid`` until it finishes; aborts it if the caller leaves."""
        done = False
        try:
            while not done:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                done = item.finished
                yield item
        finally:
            self.queues.pop(rid, None)
            if not done:
                with self.lock:
                    self.engine.abort(rid)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None):
        req, q = self.add(prompt, params, request_id)
        async for out in self.stream(req.request_id, q):
            yield out

    def shutdown(self):
        self._stop = True
        self.wake.set()
        self.thread.join(timeout=5)


def collect(outs: list[StepOutput]) -> tuple[str, list[int], str | None]:
    text = "".join(o.new_text for o in outs)
    ids = [t for o in outs for t in o.new_token_ids]
    return text, ids, outs[-1].finish_reason if outs else None
