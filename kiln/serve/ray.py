"""kiln replicas under Ray Serve: each replica is a kiln :class:`Server` (models, dynamic
batcher, metrics) whose KServe v2 HTTP routes Ray's proxy reaches; Ray places, scales and
restarts the replicas. kiln grows no cluster manager of its own.

    from ray import serve
    from kiln.serve.ray import deployment
    serve.run(deployment("models", num_replicas=2))          # or autoscaling={...}

or from the command line with Ray's tools (``deploy/ray/serve_config.yaml``):

    serve run kiln.serve.ray:app model_repository=models num_replicas=2
"""

from __future__ import annotations

from ray import serve
from starlette.requests import Request
from starlette.responses import Response


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64,
                  health_check_period_s=10)
class KilnReplica:
    """One kiln server without listening sockets: Ray's proxy hands it the HTTP requests."""

    async def __init__(self, model_repository: str, options: dict | None = None):
        from kiln.serve.http import create_app
        from kiln.serve.server import ServeConfig, Server

        cfg = ServeConfig(model_repository=model_repository, http_port=None, grpc_port=None,
                          metrics_port=None, **(options or {}))
        self.server = Server(cfg)
        await self.server.start()
        self.app = create_app(self.server)
        self.metrics_app = None

    async def check_health(self) -> None:
        if not self.server.ready():
            raise RuntimeError("kiln replica: not every model is ready")

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics":
            return Response(self.server.metrics.render(), media_type="text/plain")
        return await forward(self.app, request)


async def forward(app, request: Request) -> Response:
    """Run one request through an ASGI app in process and return its response."""
    body = await request.body()
    done = False

    async def receive():
        nonlocal done
        if done:
            return {"type": "http.disconnect"}
        done = True
        return {"type": "http.request", "body": body, "more_body": False}

    start, chunks = {}, []

    async def send(message):
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = dict(request.scope, root_path="")
    await app(scope, receive, send)
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])
               if k.lower() != b"content-length"}
    return Response(b"".join(chunks), status_code=start.get("status", 500), headers=headers)


def deployment(model_repository: str, num_replicas: int | None = 1,
               autoscaling: dict | None = None, **options):
    """A Ray Serve application of kiln replicas serving ``model_repository``.

    Args:
        num_replicas: fixed replica count (ignored when ``autoscaling`` is given).
        autoscaling: Ray Serve's ``autoscaling_config`` (``min_replicas``, ``max_replicas``,
            ``target_ongoing_requests``, ...).
        options: :class:`kiln.serve.ServeConfig` fields for every replica.
    """
    opts = {"autoscaling_config": autoscaling} if autoscaling else {}
    if num_replicas is not None and not autoscaling:
        opts["num_replicas"] = num_replicas
    return KilnReplica.options(**opts).bind(model_repository, options)


def app(args: dict):
    """Application builder for ``serve run kiln.serve.ray:app model_repository=DIR ...``."""
    args = dict(args)
    repo = args.pop("model_repository")
    n = args.pop("num_replicas", None)  # None: the Serve config's deployment settings decide
    return deployment(repo, num_replicas=None if n is None else int(n), **args)
