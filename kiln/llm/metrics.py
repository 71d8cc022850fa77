"""Engine metrics in Prometheus form: TTFT, TPOT, ITL, e2e latency, tokens/s, KV-cache usage,
running and waiting requests.

Definitions (vLLM's): TTFT = first token time - arrival; ITL = the gaps between a request's
successive tokens; TPOT = (last token - first token) / (output tokens - 1); e2e = last token -
arrival. Tokens/s is output tokens over the last ``window`` seconds.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0)
P = "kiln_llm_"


class EngineMetrics:
    def __init__(self, window: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LAT, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Time per output token",
                              buckets=_LAT, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Inter-token latency",
                             buckets=_LAT, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LAT, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(P + "request_success", "Finished requests", ["finished_reason"],
                                registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Requests preempted", registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "KV-cache blocks in use (0-1)",
                              registry=r)
        self.prefix_hit = Gauge(P + "prefix_cache_hit_rate", "Prefix-cache hit rate (0-1)",
                                registry=r)
        self.tokens_per_s = Gauge(P + "generation_tokens_per_second",
                                  f"Output tokens per second over the last {window:.0f} s",
                                  registry=r)
        self.window = window
        self._recent: deque[tuple[float, int]] = deque()

    def on_arrival(self, req):
        pass  # arrival_time lives on the request

    def on_step(self, sched, scheduler, kv, n_out: int):
        """``n_out``: tokens sampled this step (counted before ``update_from_output``, after
        which a request's ``samples`` no longer holds)."""
        now = time.monotonic()
        n_prompt = sum(min(s.num_new_tokens, max(0, s.request.num_prompt_tokens - s.start))
                       for s in sched.scheduled)
        self.prompt_tokens.inc(n_prompt)
        self.generation_tokens.inc(n_out)
        self.preemptions.inc(len(sched.preempted))
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.kv_usage.set(kv.usage)
        self.prefix_hit.set(kv.hits / kv.queries if kv.queries else 0.0)
        self._recent.append((now, n_out))
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else self.window
        self.tokens_per_s.set(sum(n for _, n in self._recent) / span)

    def on_finish(self, req):
        self.finished.labels(req.status.value).inc()
        times = req.token_times
        if not times:
            return
        self.ttft.observe(times[0] - req.arrival_time)
        self.e2e.observe(times[-1] - req.arrival_time)
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
