"""Continuous batching as a pure object: ``add_request`` / ``schedule()`` / ``update_from_output``.

There are no phases: each request has ``num_computed_tokens`` out of ``num_tokens`` (prompt +
output so far) and a step gives it some of the rest — the whole prompt, a chunk of it (chunked
prefill: a long prompt takes several steps and decodes keep running beside it), or the one token
it sampled last. Per step, at most ``max_num_batched_tokens`` tokens and ``max_num_seqs``
sequences; running requests go first (in arrival order), then waiting ones.

When the pool runs out of blocks, the newest running request is preempted: its blocks are freed
and it waits again with its tokens so far, to be recomputed (its prefix may still be cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.llm.kv_cache import KVCacheManager
from kiln.llm.request import Request, Status


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # position of the first new token (= num_computed_tokens at schedule time)
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so its logits are sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # cap a prefill chunk per step (0 = the budget)
    enable_chunked_prefill: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.eos_token_ids: tuple[int, ...] = ()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request):
        if req.request_id in self.requests:
            raise KilnError(f"request id {req.request_id!r} is already in flight")
        if not req.prompt_token_ids:
            raise KilnError(f"request {req.request_id}: the prompt is empty")
        limit = self.config.max_model_len
        if req.num_prompt_tokens >= limit:
            raise KilnError(f"request {req.request_id}: prompt of {req.num_prompt_tokens} tokens "
                            f"does not fit the model length {limit}; shorten it")
        if req.max_total_tokens > limit:  # clip to the context, as the OpenAI API does
            req.params.max_tokens = limit - req.num_prompt_tokens
        self.kv.check_fits(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str):
        req = self.requests.get(request_id)
        if req is not None and not req.status.finished:
            self._finish(req, Status.FINISHED_ABORTED)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:  # a whole prompt that does not fit this step's budget
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._entry(req, n))
                scheduled.add(req.request_id)
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing later in the list can run either
        if out.preempted:  # whoever was just preempted waits for the next step
            return self._done(out)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.computed_prefix(req)
            if req.num_computed_tokens == 0:
                req.num_computed_tokens = hit
                if req.num_preemptions == 0:
                    req.num_cached_tokens = hit
            n = self._chunk(req, budget)
            if n == 0 or not self.kv.allocate(req, n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append(self._entry(req, n))
            budget -= n
        return self._done(out)

    def _chunk(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        cap = self.config.long_prefill_token_threshold
        if cap and n > 1:
            n = min(n, cap)
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(n, budget)

    def _entry(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, req.num_computed_tokens,
                                self.kv.block_table(req.request_id))

    def _done(self, out: SchedulerOutput) -> SchedulerOutput:
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _preempt(self, req: Request, out: SchedulerOutput):
        self.running.remove(req)
        self.kv.free_request(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    # -- after the model ran -------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           now: float) -> list[tuple[Request, int | None]]:
        """Advance every scheduled request; append the tokens sampled for those that sampled.

        Returns (request, new token or None) per scheduled request; finished requests have a
        ``FINISHED_*`` status and their blocks are freed.
        """
        events = []
        for s in out.scheduled:
            req = s.request
            if req.status.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens = s.start + s.num_new_tokens
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            tok = sampled.get(req.request_id) if s.samples else None
            if tok is not None:
                req.output_token_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                req.token_times.append(now)
                self._check_stop(req, tok)
            events.append((req, tok))
        return events

    def _check_stop(self, req: Request, tok: int):
        p = req.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            self._finish(req, Status.FINISHED_STOPPED)
        elif tok in p.stop_token_ids:
            req.stop_reason = tok
            self._finish(req, Status.FINISHED_STOPPED)
        elif len(req.output_token_ids) >= p.max_tokens:
            self._finish(req, Status.FINISHED_LENGTH)

    def finish(self, request_id: str, status: Status, reason=None):
        """End a request from outside (a stop string found by the detokenizer)."""
        req = self.requests.get(request_id)
        if req is not None and not req.status.finished:
            req.stop_reason = reason
            self._finish(req, status)

    def _finish(self, req: Request, status: Status):
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free_request(req.request_id)
        self.requests.pop(req.request_id, None)
