"""KServe v2 over HTTP (FastAPI): health, metadata, config, statistics, inference with JSON
tensors and the binary-data extension, and the model-repository extension. Errors are
``{"error": "..."}`` with the status of :class:`kiln.serve.errors.Kind`.

Other parts of kiln add routes through ``create_app(server, extra_routers=[router])``; they
reach the server (models, metrics registry) as ``request.app.state.server``.
"""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from starlette.exceptions import HTTPException

from kiln.serve import datatypes
from kiln.serve.errors import Kind, ServeError, invalid
from kiln.serve.infer import InferRequest, RequestedOutput
from kiln.serve.stats import model_stats

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data", "model_repository", "statistics", "model_configuration",
              "schedule_policy"]


def create_app(server, extra_routers=()) -> FastAPI:
    """The HTTP app of ``server``, with ``extra_routers`` (FastAPI ``APIRouter``s) mounted."""
    app = FastAPI(title="kiln serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.include_router(_v2_router())
    for r in extra_routers:
        app.include_router(r)

    @app.exception_handler(ServeError)
    async def _serve_error(request, e: ServeError):
        return JSONResponse({"error": e.message}, status_code=e.kind.http_status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return JSONResponse({"error": f"{e.detail}: {request.method} {request.url.path}"},
                            status_code=e.status_code)

    return app


def create_metrics_app(server) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics():
        return Response(server.render_metrics(), media_type="text/plain; version=0.0.4")

    return app


def _v2_router() -> APIRouter:
    r = APIRouter()

    @r.get("/v2/health/live")
    async def live(request: Request):
        return _status(request.app.state.server.live())

    @r.get("/v2/health/ready")
    async def ready(request: Request):
        return _status(request.app.state.server.ready())

    @r.get("/v2")
    async def server_metadata():
        import kiln

        return {"name": "kiln", "version": kiln.__version__, "extensions": EXTENSIONS}

    @r.get("/v2/models/stats")
    async def all_stats(request: Request):
        return {"model_stats": model_stats(request.app.state.server.models, "", "")}

    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_api_route(prefix, model_metadata, methods=["GET"])
        r.add_api_route(prefix + "/ready", model_ready, methods=["GET"])
        r.add_api_route(prefix + "/config", model_config, methods=["GET"])
        r.add_api_route(prefix + "/stats", stats, methods=["GET"])
        r.add_api_route(prefix + "/infer", infer, methods=["POST"])

    @r.post("/v2/repository/index")
    async def index(request: Request):
        body = await _read_json(request, allow_empty=True)
        entries = request.app.state.server.models.index()
        if body.get("ready"):
            entries = [e for e in entries if e["state"] == "READY"]
        return entries

    @r.post("/v2/repository/models/{model}/load")
    async def load(model: str, request: Request):
        await _read_json(request, allow_empty=True)
        await request.app.state.server.load_model(model)
        return Response(status_code=200)

    @r.post("/v2/repository/models/{model}/unload")
    async def unload(model: str, request: Request):
        await _read_json(request, allow_empty=True)
        await request.app.state.server.unload_model(model)
        return Response(status_code=200)

    return r


def _status(ok: bool) -> Response:
    return Response(status_code=200 if ok else 503)


async def model_metadata(request: Request, model: str, version: str = ""):
    mv = request.app.state.server.models.get(model, version)
    m = request.app.state.server.models.models[model]
    nb = [-1] if mv.batched else []
    return {"name": model, "versions": [str(v) for v in sorted(m.versions)],
            "platform": mv.config.platform or mv.config.backend,
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": nb + list(s.dims)}
                       for s in mv.inputs],
            "outputs": [{"name": s.name, "datatype": s.datatype, "shape": nb + list(s.dims)}
                        for s in mv.outputs]}


async def model_ready(request: Request, model: str, version: str = ""):
    try:
        request.app.state.server.models.get(model, version)
    except ServeError as e:
        if e.kind is Kind.NOT_FOUND and model not in request.app.state.server.models.models:
            raise
        return _status(False)
    return _status(not request.app.state.server.draining)


async def model_config(request: Request, model: str, version: str = ""):
    mv = request.app.state.server.models.get(model, version)
    return json_format.MessageToDict(mv.config, preserving_proto_field_name=True)


async def stats(request: Request, model: str, version: str = ""):
    server = request.app.state.server
    server.models.get(model, version)  # 404 for an unknown model
    return {"model_stats": model_stats(server.models, model, version)}


async def infer(request: Request, model: str, version: str = ""):
    server = request.app.state.server
    body = await _read_body(request, server.config.max_body_bytes)
    req, binary_default = _parse_infer(body, request.headers.get(HEADER_LENGTH), model,
                                       version, server.config.max_json_depth)
    mv, outs = await server.infer(req)
    return _infer_response(request, req, mv, outs, binary_default)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ServeError(Kind.TOO_LARGE, f"request body of {declared} bytes is over the "
                         f"limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServeError(Kind.TOO_LARGE, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    enc = request.headers.get("content-encoding", "").lower()
    if enc in ("gzip", "deflate"):
        d = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
        try:
            body = d.decompress(body, limit + 1)
        except zlib.error as e:
            raise invalid(f"request body is not valid {enc} data ({e})") from None
        if len(body) > limit or d.unconsumed_tail:
            raise ServeError(Kind.TOO_LARGE, f"decompressed request body is over the limit "
                             f"of {limit} bytes")
    elif enc not in ("", "identity"):
        raise invalid(f"unsupported Content-Encoding '{enc}' (use gzip or deflate)")
    return body


async def _read_json(request: Request, allow_empty=False) -> dict:
    server = request.app.state.server
    body = await _read_body(request, server.config.max_body_bytes)
    if not body and allow_empty:
        return {}
    obj = _loads(body, server.config.max_json_depth)
    if not isinstance(obj, dict):
        raise invalid("request body must be a JSON object")
    return obj


def _loads(raw: bytes, max_depth: int):
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise invalid(f"request JSON is nested deeper than {max_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(f"request body is not valid JSON ({e})") from None
    _check_depth(obj, max_depth)
    return obj


def _check_depth(obj, max_depth: int) -> None:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > max_depth:
            raise invalid(f"request JSON is nested deeper than {max_depth} levels")
        items = o.values() if isinstance(o, dict) else o
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))


def _parse_infer(body: bytes, header_len, model: str, version: str, max_depth: int):
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(body):
            raise invalid(f"{HEADER_LENGTH} is {header_len!r}, but the body has {len(body)} "
                          f"bytes")
        n = int(header_len)
        head, blob = body[:n], memoryview(body)[n:]
    else:
        head, blob = body, memoryview(b"")
    obj = _loads(head, max_depth)
    if not isinstance(obj, dict) or not isinstance(obj.get("inputs"), list):
        raise invalid("inference request must be a JSON object with an 'inputs' list")
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid("'parameters' must be a JSON object")
    req = InferRequest(model, version, str(obj.get("id", "")), parameters=params)
    pos = 0
    for i, t in enumerate(obj["inputs"]):
        name, dtype, x, used = _parse_input(t, i, blob, pos)
        if name in req.inputs:
            raise invalid(f"input '{name}' is given twice")
        req.inputs[name] = (dtype, x)
        pos += used
    if pos != len(blob):
        raise invalid(f"{len(blob) - pos} bytes of binary data are not claimed by any input's "
                      f"binary_data_size")
    if "outputs" in obj:
        if not isinstance(obj["outputs"], list):
            raise invalid("'outputs' must be a list")
        req.outputs = []
        for o in obj["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise invalid("each requested output needs a 'name'")
            p = o.get("parameters") or {}
            req.outputs.append(RequestedOutput(o["name"], p.get("binary_data"), p))
    return req, bool(params.get("binary_data_output", False))


def _parse_input(t, i: int, blob: memoryview, pos: int):
    if not isinstance(t, dict):
        raise invalid(f"inputs[{i}] must be a JSON object")
    name, dtype, shape = t.get("name"), t.get("datatype"), t.get("shape")
    if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list):
        raise invalid(f"inputs[{i}] needs 'name', 'datatype' and 'shape'")
    where = f"input '{name}'"
    shape = tuple(shape)
    count = datatypes.element_count(shape, where)
    size = (t.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or pos + size > len(blob):
            raise invalid(f"{where}: binary_data_size {size!r} runs past the binary data "
                          f"({len(blob) - pos} bytes left)")
        return name, dtype, datatypes.from_raw(blob[pos:pos + size], dtype, shape, where), size
    if "data" not in t:
        raise invalid(f"{where}: no 'data' and no binary_data_size")
    np_dtype = datatypes.numpy_dtype(dtype, where)
    data = t["data"]
    try:
        if dtype == "BYTES":
            flat = np.array([s.encode() if isinstance(s, str) else bytes(s)
                             for s in np.array(data, dtype=object).reshape(-1)], dtype=object)
        else:
            flat = np.asarray(data, dtype=np_dtype).reshape(-1)
    except (TypeError, ValueError) as e:
        raise invalid(f"{where}: 'data' does not hold {dtype} values ({e})") from None
    if flat.size != count:
        raise invalid(f"{where}: {flat.size} values for shape {list(shape)} ({count} elements)")
    return name, dtype, flat.reshape(shape), 0


def _infer_response(request: Request, req: InferRequest, mv, outs: dict, binary_default):
    specs = {s.name: s for s in mv.outputs}
    wanted = req.outputs if req.outputs is not None else [
        RequestedOutput(s.name) for s in mv.outputs]
    out_json, blobs = [], []
    for o in wanted:
        x = np.asarray(outs[o.name])
        dtype = specs[o.name].datatype
        entry = {"name": o.name, "datatype": dtype, "shape": list(x.shape)}
        binary = binary_default if o.binary is None else bool(o.binary)
        if binary:
            raw = datatypes.to_raw(x)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif dtype == "BYTES":
            entry["data"] = [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                             for v in x.reshape(-1)]
        else:
            entry["data"] = x.reshape(-1).tolist()
        out_json.append(entry)
    head = {"model_name": mv.name, "model_version": str(mv.version), "outputs": out_json}
    if req.id:
        head["id"] = req.id
    head_bytes = json.dumps(head, separators=(",", ":")).encode()
    headers = {}
    if blobs:
        headers[HEADER_LENGTH] = str(len(head_bytes))
        body, media = b"".join([head_bytes, *blobs]), "application/octet-stream"
    else:
        body, media = head_bytes, "application/json"
    accept = request.headers.get("accept-encoding", "")
    if "gzip" in accept:
        body, headers["Content-Encoding"] = gzip.compress(body, 1), "gzip"
    elif "deflate" in accept:
        body, headers["Content-Encoding"] = zlib.compress(body, 1), "deflate"
    return Response(body, media_type=media, headers=headers)
