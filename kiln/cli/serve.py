"""kiln serve: serve a model repository over KServe v2 HTTP and gRPC (docs/serving.md)."""

from __future__ import annotations

import asyncio
import importlib

from kiln.cli.args import add_common_args
from kiln.errors import KilnError

NAME = "serve"
HELP = "serve a model repository over KServe v2 HTTP/gRPC with dynamic batching"


def add_arguments(p):
    p.add_argument("--model-repository", required=True, metavar="DIR",
                   help="folder of <model>/config.pbtxt and <model>/<version>/model.{kiln,onnx}")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="Prometheus /metrics port (default 8002)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--model-control-mode", choices=["none", "poll", "explicit"],
                   default="none", help="none: load all at start; poll: also reload what "
                   "changes on disk; explicit: load on request (default none)")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="with explicit control: a model to load at start (repeatable)")
    p.add_argument("--repository-poll-secs", type=float, default=15.0,
                   help="seconds between repository scans with poll control (default 15)")
    p.add_argument("--max-body-mb", type=float, default=64,
                   help="largest request body, also after decompression (default 64 MiB)")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds a request may take end to end; 0: no limit (default 60)")
    p.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight (default 30)")
    p.add_argument("--cache-dir", help="where engines built from .onnx versions are cached")
    p.add_argument("--router", action="append", default=[], metavar="MODULE:ATTR",
                   help="mount a FastAPI APIRouter (or a function returning one) on the "
                   "HTTP app, e.g. kiln.llm.http:router (repeatable)")
    p.add_argument("--llm", metavar="MODEL",
                   help="also serve this LLM (a .gguf, a Hugging Face directory, or smollm2) "
                   "on the same HTTP app: /v1/completions, /v1/chat/completions, /v1/models, "
                   "v2 generate; its metrics on /metrics")
    p.add_argument("--llm-name", metavar="NAME",
                   help="the LLM's model name in the API (default: the file's stem)")
    p.add_argument("--llm-weights", choices=["dtype", "int8", "int4", "fp8"],
                   default="dtype",
                   help="the LLM's GEMM weights: in its dtype, weight-only int8/int4 (CPU) "
                   "or fp8 (CUDA) (default dtype)")
    p.add_argument("--llm-kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="the LLM's KV cache: in its dtype (auto) or fp8 e4m3 (twice the blocks)")
    add_common_args(p)


def load_router(spec: str):
    mod, sep, attr = spec.partition(":")
    if not sep:
        raise KilnError(f"bad --router '{spec}': write it as module:attribute")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise KilnError(f"--router '{spec}': {e}") from None
    return obj() if callable(obj) and not hasattr(obj, "routes") else obj


def main(args) -> int:
    from kiln.llm.engine import EngineConfig
    from kiln.serve.server import ServeConfig, Server

    cfg = ServeConfig(
        model_repository=args.model_repository, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, host=args.host,
        model_control_mode=args.model_control_mode, load_models=tuple(args.load_model),
        poll_interval=args.repository_poll_secs, max_body_bytes=int(args.max_body_mb * 2**20),
        request_timeout=args.request_timeout, grace_period=args.grace_period,
        cache_dir=args.cache_dir, extra_routers=tuple(load_router(r) for r in args.router),
        llm=args.llm, llm_name=args.llm_name, llm_engine=EngineConfig(
            weights=args.llm_weights, kv_cache_dtype=args.llm_kv_cache_dtype))

    async def run():
        return await Server(cfg).serve()

    return asyncio.run(run())
