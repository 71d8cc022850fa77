"""The server: the model manager, the HTTP, gRPC and metrics endpoints on one event loop, model
control (none | poll | explicit), and shutdown that drains requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.serve.errors import Kind, ServeError, unavailable
from kiln.serve.infer import InferRequest, check_request
from kiln.serve.metrics import Metrics
from kiln.serve.model import ModelManager, version_signature
from kiln.serve.repository import Repository, select_versions

CONTROL_MODES = ("none", "poll", "explicit")


@dataclass
class ServeConfig:
    """Everything ``kiln serve`` takes.

    Args:
        model_repository: the repository folder (``<model>/config.pbtxt``, ``<model>/<n>/``).
        http_port, grpc_port, metrics_port: ports (0: any free port; None: that endpoint off).
        host: address to listen on.
        model_control_mode: ``none`` loads every model at start and never again; ``poll``
            also rescans the repository every ``poll_interval`` seconds and reloads what
            changed; ``explicit`` loads only ``load_models`` and what the repository API asks.
        max_body_bytes: largest request body, also after decompression (413 beyond).
        max_json_depth: deepest JSON nesting accepted (400 beyond).
        request_timeout: seconds a request may take end to end (504 beyond); 0: no limit.
        grace_period: seconds SIGTERM waits for requests in flight before cutting them.
        cache_dir: where engines built from ONNX versions are cached (default: a
            ``.kiln-cache`` folder in each version folder).
        extra_routers: FastAPI ``APIRouter``s mounted on the HTTP app (e.g. OpenAI routes).
        llm: an LLM to serve beside the repository (a ``.gguf``, an HF directory, ``smollm2``):
            the OpenAI routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``)
            and v2 ``generate``/``generate_stream`` on the same HTTP app, its metrics on
            ``/metrics``; ``llm_name`` names it (default: the file's stem), ``llm_engine`` is
            its ``kiln.llm.EngineConfig`` (default: the CPU/CUDA defaults).
    """

    model_repository: str
    http_port: int | None = 8000
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    host: str = "0.0.0.0"
    model_control_mode: str = "none"
    load_models: tuple[str, ...] = ()
    poll_interval: float = 15.0
    max_body_bytes: int = 64 << 20
    max_json_depth: int = 64
    request_timeout: float = 60.0
    grace_period: float = 30.0
    cache_dir: str | None = None
    extra_routers: tuple = field(default_factory=tuple)
    llm: str | None = None
    llm_name: str | None = None
    llm_engine: object = None

    def __post_init__(self):
        if self.model_control_mode not in CONTROL_MODES:
            raise KilnError(f"model control mode must be one of {', '.join(CONTROL_MODES)}, "
                            f"not '{self.model_control_mode}'")


class Server:
    """``await server.serve()`` runs until SIGTERM/SIGINT (or :meth:`stop`) and returns the
    exit code: 0, or 1 when the grace period cut requests in flight."""

    def __init__(self, config: ServeConfig, registry=None, log=None):
        self.config = config
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.metrics = Metrics(registry)
        self.repository = Repository(config.model_repository, config.cache_dir)
        self.models = ModelManager(self.repository, self.metrics.observe_execution, self.log)
        self.metrics.pending_source = self.models.pending
        self.draining = False
        self.inflight = 0
        self.ports: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._uvicorn: dict[str, object] = {}
        self._grpc = None
        self.llm = None  # kiln.llm.AsyncLLM when config.llm is set

    # --- health --------------------------------------------------------------------------
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self.draining and self.models.ready()

    def _load_llm(self):
        from kiln.llm.async_engine import AsyncLLM
        from kiln.llm.engine import LLMEngine

        engine = LLMEngine(self.config.llm, self.config.llm_engine)
        if self.config.llm_name:
            engine.model_name = self.config.llm_name
        return AsyncLLM(engine)

    def render_metrics(self) -> bytes:
        """Triton's metrics, then the LLM's (``kiln_llm_*``) when one is served."""
        text = self.metrics.render()
        if self.llm is not None:
            text += self.llm.engine.metrics.render()
        return text

    # --- inference -----------------------------------------------------------------------
    async def infer(self, req: InferRequest):
        """Run one request: returns ``(model_version, {output: array})`` or raises
        :class:`ServeError`."""
        if self.draining:
            raise unavailable("the server is shutting down; send the request elsewhere")
        mv = self.models.get(req.model, req.version)
        t0 = time.perf_counter()
        self.inflight += 1
        error = None
        try:
            feeds, rows, key = check_request(mv, req)
            if mv.scheduler is None:
                raise unavailable(f"model '{mv.name}' is not started")
            fut = mv.scheduler.enqueue(feeds, rows, key, req.timeout())
            limit = self.config.request_timeout
            timer = asyncio.get_running_loop().call_later(
                limit, _time_out, fut, f"request to '{mv.name}' took longer than {limit} s "
                f"(the server's request timeout)") if limit else None
            try:
                outs, _ = await fut
            finally:
                if timer is not None:
                    timer.cancel()
            return mv, outs
        except ServeError as e:
            error = e
            raise
        finally:
            self.inflight -= 1
            self.metrics.request_done(mv.name, str(mv.version), time.perf_counter() - t0,
                                      error)

    # --- model control -------------------------------------------------------------------
    async def load_model(self, name: str) -> None:
        if self.config.model_control_mode != "explicit":
            raise ServeError(Kind.UNAVAILABLE, "explicit model load/unload is not allowed "
                             "(start kiln serve with --model-control-mode explicit)")
        try:
            await self.models.load(name)
        except KilnError as e:
            raise ServeError(Kind.INVALID, f"failed to load '{name}': {e}") from None

    async def unload_model(self, name: str) -> None:
        if self.config.model_control_mode != "explicit":
            raise ServeError(Kind.UNAVAILABLE, "explicit model load/unload is not allowed "
                             "(start kiln serve with --model-control-mode explicit)")
        await self.models.unload(name)

    async def _load_initial(self) -> None:
        mode = self.config.model_control_mode
        names = list(self.config.load_models) if mode == "explicit" else \
            self.repository.model_names()
        for name in names:
            with contextlib.suppress(KilnError):  # logged; the server is not ready then
                await self.models.load(name)

    async def poll_once(self) -> None:
        """Reload models whose files changed, load new ones, unload removed ones."""
        present = set(self.repository.model_names())
        for name in sorted(present):
            m = self.models.models.get(name)
            if m is not None and m.versions and not await asyncio.to_thread(_changed, self, m):
                continue
            with contextlib.suppress(KilnError):
                await self.models.load(name)
        for name in sorted(set(self.models.models) - present):
            await self.models.unload(name)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval)
            try:
                await self.poll_once()
            except Exception as e:  # a bad poll must not stop polling
                self.log(f"kiln serve: repository poll failed: {e}")

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the models and open the endpoints (returns once they listen)."""
        await self._load_initial()
        cfg = self.config
        routers = tuple(cfg.extra_routers)
        if cfg.llm is not None:
            from kiln.llm.api import make_router

            self.llm = await asyncio.to_thread(self._load_llm)
            routers += (make_router(self.llm, include_metrics=False),)
            self.log(f"kiln serve: LLM '{self.llm.model_name}' on /v1 (OpenAI) and "
                     f"/v2/models/{self.llm.model_name}/generate")
        if cfg.http_port is not None:
            from kiln.serve.http import create_app

            app = create_app(self, extra_routers=routers)
            self.ports["http"] = await self._start_uvicorn("http", app, cfg.http_port)
        if cfg.metrics_port is not None:
            from kiln.serve.http import create_metrics_app

            self.ports["metrics"] = await self._start_uvicorn(
                "metrics", create_metrics_app(self), cfg.metrics_port)
        if cfg.grpc_port is not None:
            from kiln.serve.grpc import start_grpc

            self._grpc, self.ports["grpc"] = await start_grpc(self, cfg.host, cfg.grpc_port)
        if cfg.model_control_mode == "poll":
            self._tasks.append(asyncio.create_task(self._poll_loop()))
        self.log(f"kiln serve: listening on {cfg.host} ("
                 + ", ".join(f"{k} {v}" for k, v in self.ports.items()) + ")")

    async def _start_uvicorn(self, name: str, app, port: int) -> int:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # kiln handles SIGTERM itself (to drain)
                yield

        conf = uvicorn.Config(app, host=self.config.host, port=port, log_level="warning",
                              access_log=False, lifespan="off",
                              timeout_graceful_shutdown=max(self.config.grace_period, 0.1))
        server = _Server(conf)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()  # raises the bind error
                raise KilnError(f"the {name} endpoint stopped while starting")
            await asyncio.sleep(0.01)
        self._uvicorn[name] = (server, task)
        return server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Begin the shutdown :meth:`serve` performs (thread-unsafe; call on the loop)."""
        self._stop.set()

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a signal while loading
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._stop.set)
        await self.start()
        await self._stop.wait()
        return await self.shutdown()

    async def shutdown(self) -> int:
        """Stop accepting, wait up to the grace period for requests in flight, close."""
        self.draining = True
        grace = self.config.grace_period
        self.log(f"kiln serve: draining {self.inflight} request(s), grace {grace} s")
        if "http" in self._uvicorn:
            self._uvicorn["http"][0].should_exit = True
        grpc_stop = self._grpc.stop(grace) if self._grpc is not None else None
        deadline = time.monotonic() + grace
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cut = self.inflight
        if grpc_stop is not None:
            await grpc_stop
        for server, task in self._uvicorn.values():
            server.should_exit = True
            with contextlib.suppress(Exception):
                await task
        for t in self._tasks:
            t.cancel()
        await self.models.close()
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)
        if cut:
            self.log(f"kiln serve: {cut} request(s) were cut by the grace period ({grace} s)")
            return 1
        self.log("kiln serve: stopped, every request answered")
        return 0


def _time_out(fut: asyncio.Future, message: str) -> None:
    if not fut.done():  # the batch still runs; its answer for this request is dropped
        fut.set_exception(ServeError(Kind.TIMEOUT, message))


def _changed(server: Server, m) -> bool:
    try:
        src = server.repository.read(m.name)
    except KilnError:
        return True
    try:
        wanted = select_versions(src)
    except KilnError:
        return True
    if sorted(wanted) != sorted(m.versions):
        return True
    return any(version_signature(src, v) != m.versions[v].signature for v in wanted)
