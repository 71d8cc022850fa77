"""kiln bench-llm: serving benchmark (TTFT, TPOT, ITL, e2e, throughput, goodput, peak memory).

Starts the model in this process behind the OpenAI-compatible server on loopback (or targets
``--url``) and sweeps concurrency levels or Poisson request rates with random-token prompts.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from kiln.cli.llm_args import add_engine_args, engine_config

NAME = "bench-llm"
HELP = "benchmark LLM serving: concurrency or request-rate sweeps, vllm-bench-serve metrics"


def add_arguments(p):
    add_engine_args(p)
    p.add_argument("--url", help="benchmark a running server instead (model is then its name)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="", help="comma list, e.g. 1,4,16 (closed loop)")
    p.add_argument("--request-rate", default="", help="comma list of requests/s (Poisson; inf)")
    p.add_argument("--slo-ttft", type=float, help="goodput SLO: TTFT in ms")
    p.add_argument("--slo-tpot", type=float, help="goodput SLO: TPOT in ms")
    p.add_argument("--slo-e2e", type=float, help="goodput SLO: e2e latency in ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def main(args) -> int:
    from kiln.llm.loadgen import run_load, summarize

    server = None
    if args.url:
        url, model, vocab = args.url.rstrip("/"), args.model, 32000
    else:
        server = _start_server(args)
        url, model = server.url, server.llm.model_name
        vocab = server.llm.engine.model.cfg.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    slo = {k: v for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot),
                             ("e2e", args.slo_e2e)) if v}
    sweep = [("concurrency", int(c)) for c in args.concurrency.split(",") if c] + \
        [("request_rate", float(r)) for r in args.request_rate.split(",") if r]
    sweep = sweep or [("concurrency", 1)]
    rows = []
    for kind, value in sweep:
        kw = {"concurrency": value} if kind == "concurrency" else {"request_rate": value}
        results, duration = asyncio.run(run_load(url, model, prompts, args.output_len,
                                                 seed=args.seed, **kw))
        row = {kind: value, **summarize(results, duration, slo)}
        if server is not None:
            row["peak_memory_mib"] = server.peak_memory_mib()
        rows.append(row)
        _print_row(row, kind, value)
        errors = [r.error for r in results if not r.ok]
        if errors:
            print(f"  first error: {errors[0]}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if server is not None:
        server.stop()
    return 0


def _print_row(row: dict, kind: str, value):
    print(f"{kind}={value}: {row['completed']} ok / {row['failed']} failed in "
          f"{row['duration_s']:.1f} s | req/s {row['request_throughput']:.2f} | out tok/s "
          f"{row['output_throughput']:.1f}" +
          (f" | goodput {row['goodput']:.2f} req/s" if "goodput" in row else ""))
    for m in ("ttft", "tpot", "itl", "e2e"):
        print(f"  {m.upper():5s} ms  mean {row[f'mean_{m}_ms']:8.1f}  p50 "
              f"{row[f'median_{m}_ms']:8.1f}  p90 {row[f'p90_{m}_ms']:8.1f}  "
              f"p99 {row[f'p99_{m}_ms']:8.1f}")
    if "peak_memory_mib" in row:
        print(f"  peak memory {row['peak_memory_mib']:.0f} MiB")


def _start_server(args):
    from kiln.llm.server import BackgroundServer

    return BackgroundServer.start(args.model, engine_config(args))
