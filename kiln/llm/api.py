"""OpenAI-compatible and KServe v2 generate routes over an ``AsyncLLM``, as a FastAPI router.

    POST /v1/completions         prompt (text, list of texts, or token ids) -> text
    POST /v1/chat/completions    messages -> the assistant's reply (the model's chat template)
    GET  /v1/models
    POST /v2/models/{name}/generate          {"text_input", "parameters"} -> {"text_output"}
    POST /v2/models/{name}/generate_stream   the same as server-sent events
    GET  /metrics                            Prometheus text (``include_metrics``)

``stream: true`` answers with server-sent events in OpenAI's framing (``data: {chunk}`` lines, a
final ``data: [DONE]``); ``stream_options.include_usage`` adds a last chunk with the token counts.
Bad requests get OpenAI's error object with status 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.errors import KilnError
from kiln.llm.async_engine import AsyncLLM
from kiln.llm.sampling import SamplingParams

_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
           "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
_UNSUPPORTED = {"logprobs", "top_logprobs", "echo", "best_of", "logit_bias", "suffix", "tools",
                "response_format"}


def _error(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "invalid_request_error",
                                   "param": None, "code": status}}, status_code=status)


def sampling_from(body: dict, default_max: int = 16) -> SamplingParams:
    """SamplingParams from an OpenAI request body (vLLM's extra fields accepted too)."""
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, [], {}):
            raise KilnError(f"'{key}' is not supported by kiln's server")
    if body.get("n", 1) != 1:
        raise KilnError("'n' other than 1 is not supported; send several requests")
    kw = {k: body[k] for k in _PARAMS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    kw.setdefault("max_tokens", default_max)
    if isinstance(kw.get("top_k"), int) and kw["top_k"] < 0:
        kw["top_k"] = 0
    return SamplingParams(**kw)


def make_router(llm: AsyncLLM, include_metrics: bool = True) -> APIRouter:
    """The LLM routes over ``llm``; mount with ``app.include_router(make_router(llm))``."""
    r = APIRouter()
    h = _Handlers(llm)
    r.add_api_route("/v1/models", h.models, methods=["GET"])
    r.add_api_route("/v1/completions", h.completions, methods=["POST"])
    r.add_api_route("/v1/chat/completions", h.chat, methods=["POST"])
    r.add_api_route("/v2/models/{name}/generate", h.v2_generate, methods=["POST"])
    r.add_api_route("/v2/models/{name}/generate_stream", h.v2_generate_stream, methods=["POST"])
    if include_metrics:
        r.add_api_route("/metrics", h.metrics, methods=["GET"])
    return r


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Handlers:
    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.created = int(time.time())

    async def models(self):
        return {"object": "list", "data": [{"id": self.llm.model_name, "object": "model",
                                            "created": self.created, "owned_by": "kiln"}]}

    async def metrics(self):
        return Response(self.llm.engine.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _body(self, request: Request) -> dict:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise KilnError(f"request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise KilnError("request body must be a JSON object")
        return body

    async def completions(self, request: Request):
        try:
            streams = []
            body = await self._body(request)
            params = sampling_from(body)
            prompts = _prompts(body.get("prompt"))
            for p in prompts:
                streams.append(self.llm.add(p, _fresh(params)))
        except (KilnError, ValueError, TypeError) as e:
            for req, _ in streams:  # the prompts queued before the bad one
                self.llm.abort(req.request_id)
            return _error(str(e))
        rid = f"cmpl-{uuid.uuid4().hex}"
        frame = {"id": rid, "object": "text_completion", "created": int(time.time()),
                 "model": self.llm.model_name}
        if body.get("stream"):
            usage = (body.get("stream_options") or {}).get("include_usage", False)
            return StreamingResponse(self._stream_completion(streams, frame, usage),
                                     media_type="text/event-stream")
        results = await asyncio.gather(*[_drain(self.llm, req, q) for req, q in streams])
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": fin}
                   for i, (text, _, fin) in enumerate(results)]
        return {**frame, "choices": choices, "usage": _usage(streams, results)}

    async def _stream_completion(self, streams, frame, include_usage):
        n_out = 0
        async for i, out in _merge(self.llm, streams):
            n_out += len(out.new_token_ids)
            if not out.new_text and not out.finished:
                continue
            choice = {"index": i, "text": out.new_text, "logprobs": None,
                      "finish_reason": out.finish_reason}
            yield _sse({**frame, "choices": [choice], **({"usage": None} if include_usage
                                                         else {})})
        if include_usage:
            yield _sse({**frame, "choices": [], "usage": _counts(streams, n_out)})
        yield "data: [DONE]\n\n"

    async def chat(self, request: Request):
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise KilnError("'messages' must be a non-empty list of {role, content}")
            params = sampling_from(body, default_max=body.get("max_tokens") or 256)
            prompt = self.llm.tokenizer.apply_chat_template(
                [{"role": m.get("role"), "content": _content(m)} for m in messages])
            req, q = self.llm.add(prompt, params)
        except (KilnError, ValueError, TypeError) as e:
            return _error(str(e))
        frame = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                 "model": self.llm.model_name}
        if body.get("stream"):
            usage = (body.get("stream_options") or {}).get("include_usage", False)
            return StreamingResponse(self._stream_chat(req, q, frame, usage),
                                     media_type="text/event-stream")
        text, ids, fin = await _drain(self.llm, req, q)
        return {**frame, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": fin}],
                "usage": _counts([(req, q)], len(ids))}

    async def _stream_chat(self, req, q, frame, include_usage):
        frame = {**frame, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}

        def chunk(delta, fin=None):
            return _sse({**frame, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                               "finish_reason": fin}], **extra})
        yield chunk({"role": "assistant", "content": ""})
        n_out = 0
        async for out in self.llm.stream(req.request_id, q):
            n_out += len(out.new_token_ids)
            if out.new_text:
                yield chunk({"content": out.new_text})
            if out.finished:
                yield chunk({}, out.finish_reason)
        if include_usage:
            yield _sse({**frame, "choices": [], "usage": _counts([(req, q)], n_out)})
        yield "data: [DONE]\n\n"

    async def v2_generate(self, name: str, request: Request):
        try:
            req, q = await self._v2_add(name, request)
        except (KilnError, ValueError, TypeError) as e:
            return _error(str(e), 404 if "no model" in str(e) else 400)
        text, _, fin = await _drain(self.llm, req, q)
        return {"model_name": name, "model_version": "1", "text_output": text,
                "finish_reason": fin}

    async def v2_generate_stream(self, name: str, request: Request):
        try:
            req, q = await self._v2_add(name, request)
        except (KilnError, ValueError, TypeError) as e:
            return _error(str(e), 404 if "no model" in str(e) else 400)

        async def events():
            async for out in self.llm.stream(req.request_id, q):
                yield _sse({"model_name": name, "model_version": "1",
                            "text_output": out.new_text, "finish_reason": out.finish_reason})
        return StreamingResponse(events(), media_type="text/event-stream")

    async def _v2_add(self, name: str, request: Request):
        if name != self.llm.model_name:
            raise KilnError(f"no model named {name!r} (this server has {self.llm.model_name!r})")
        body = await self._body(request)
        text = body.get("text_input")
        if not isinstance(text, str):
            raise KilnError("'text_input' (a string) is required")
        params = sampling_from(body.get("parameters") or {})
        return self.llm.add(text, params)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    raise KilnError("'prompt' must be a string, a list of strings, or a list of token ids")


def _content(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, list):  # [{"type": "text", "text": ...}]
        return "".join(part.get("text", "") for part in c if isinstance(part, dict))
    return c or ""


def _fresh(p: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(p)


async def _drain(llm: AsyncLLM, req, q):
    outs = [o async for o in llm.stream(req.request_id, q)]
    from kiln.llm.async_engine import collect

    return collect(outs)


async def _merge(llm: AsyncLLM, streams):
    """(choice index, StepOutput) from several requests' streams, as they come."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i, req, q):
        try:
            async for out in llm.stream(req.request_id, q):
                await merged.put((i, out))
        finally:
            await merged.put((i, None))
    tasks = [asyncio.create_task(pump(i, req, q)) for i, (req, q) in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, out = await merged.get()
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _counts(streams, n_out: int) -> dict:
    n_in = sum(req.num_prompt_tokens for req, _ in streams)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def _usage(streams, results) -> dict:
    return _counts(streams, sum(len(ids) for _, ids, _ in results))


def create_app(llm: AsyncLLM):
    """A FastAPI app with the LLM routes and /health (until ``kiln serve`` mounts them)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    @asynccontextmanager
    async def lifespan(app):
        yield
        llm.shutdown()

    app = FastAPI(title="kiln LLM server", lifespan=lifespan)
    app.include_router(make_router(llm))

    @app.get("/health")
    async def health():
        return {"status": "ok" if llm.error is None else f"engine error: {llm.error}"}
    return app
