"""A load generator for OpenAI-compatible servers, with ``vllm bench serve``'s definitions.

Per request (streamed ``/v1/completions``): TTFT = first content chunk - send; ITL = gaps between
content chunks; TPOT = (e2e - TTFT) / (output tokens - 1); e2e = last chunk - send. Output
tokens come from the server's usage (``stream_options.include_usage``). Over the run:
request throughput = completed / duration, output throughput = output tokens / duration,
goodput = requests meeting every SLO (TTFT, TPOT, e2e in ms) / duration. Arrivals: a fixed
concurrency (closed loop), or Poisson at ``request_rate`` requests/s (inter-arrival times
exponential, seeded), optionally capped by a concurrency limit.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0


async def one_request(client, url: str, model: str, prompt, max_tokens: int,
                      ignore_eos: bool = True) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    res = RequestResult()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = last - t0
        res.ok = True
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, prompts: list, max_tokens: int, concurrency: int = 0,
                   request_rate: float = float("inf"), seed: int = 0) -> tuple[list, float]:
    """Send every prompt; returns (results, duration in s)."""
    try:
        import httpx
    except ImportError:  # openai >= 3 ships httpx as httpx2
        import httpx2 as httpx

    limit = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    rng = random.Random(seed)
    timeout = httpx.Timeout(None)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as c:
        async def guarded(p):
            if limit is None:
                return await one_request(c, url, model, p, max_tokens)
            async with limit:
                return await one_request(c, url, model, p, max_tokens)
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(guarded(p)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], duration: float, slo: dict | None = None,
              percentiles=(50, 90, 99)) -> dict:
    """The metrics of one run; times in ms. ``slo``: {"ttft"|"tpot"|"e2e": ms}."""
    ok = [r for r in results if r.ok]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok)}
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) \
        / duration
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        a = np.asarray(xs or [0.0]) * 1000
        out[f"mean_{name}_ms"] = float(a.mean())
        out[f"median_{name}_ms"] = float(np.median(a))
        for p in percentiles:
            out[f"p{p}_{name}_ms"] = float(np.percentile(a, p))
    if slo:
        good = [r for r in ok if all(getattr(r, k) * 1000 <= v for k, v in slo.items())]
        out["goodput"] = len(good) / duration
    return out
