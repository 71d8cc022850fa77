"""kiln serve: an inference server for kiln engines that speaks the KServe v2 / Open Inference
Protocol over HTTP and gRPC (what Triton Inference Server speaks), with a dynamic batcher per
model, a model repository with hot reload, Prometheus metrics and request limits.

    from kiln.serve import Server, ServeConfig
    server = Server(ServeConfig(model_repository="models"))
    exit_code = asyncio.run(server.serve())

See docs/serving.md.
"""

from kiln.serve.errors import ServeError
from kiln.serve.server import ServeConfig, Server

__all__ = ["ServeConfig", "Server", "ServeError"]
