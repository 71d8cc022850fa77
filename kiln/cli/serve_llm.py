"""kiln serve-llm: an OpenAI-compatible HTTP server (plus KServe v2 generate) for one LLM."""

from __future__ import annotations

from kiln.cli.llm_args import add_engine_args, engine_config

NAME = "serve-llm"
HELP = "serve an LLM over HTTP: /v1/completions, /v1/chat/completions, v2 generate, /metrics"


def add_arguments(p):
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def main(args) -> int:
    import uvicorn

    from kiln.llm.api import create_app
    from kiln.llm.async_engine import AsyncLLM
    from kiln.llm.engine import LLMEngine

    llm = AsyncLLM(LLMEngine(args.model, engine_config(args)))
    print(f"kiln serve-llm: {llm.model_name} on http://{args.host}:{args.port}/v1")
    uvicorn.run(create_app(llm), host=args.host, port=args.port, log_level="warning")
    return 0
