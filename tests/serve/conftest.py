"""Fixtures of the serving tests: tiny ONNX models made here, model repositories in tmp
folders, and a real server (HTTP, gRPC, metrics on free loopback ports) in a thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.serve.server import ServeConfig, Server


def matmul_model(scale: float = 1.0, width: int = 4) -> onnx.ModelProto:
    """y = x @ W with W = scale * arange: a version's outputs say which version ran."""
    w = scale * np.arange(width * width, dtype=np.float32).reshape(width, width)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        [numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def fixed_model() -> onnx.ModelProto:
    """z = relu(a) + b on fixed [2, 3] float inputs (no batch dim)."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Add", ["r", "b"], ["z"])],
        "fixed",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def expected(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    w = scale * np.arange(x.shape[1] ** 2, dtype=np.float32).reshape(x.shape[1], -1)
    return x @ w


MATMUL_CONFIG = """
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""


def write_model(repo: Path, name: str, version: int, model: onnx.ModelProto,
                config: str | None = None) -> Path:
    d = repo / name / str(version)
    d.mkdir(parents=True, exist_ok=True)
    onnx.save(model, d / "model.onnx")
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)
    return d


class ServerThread:
    """A real :class:`Server` on its own event loop in a thread, every port chosen free."""

    def __init__(self, **kw):
        kw.setdefault("host", "127.0.0.1")
        for k in ("http_port", "grpc_port", "metrics_port"):
            kw.setdefault(k, 0)
        self.config = ServeConfig(**kw)
        self.loop = asyncio.new_event_loop()
        self.logs: list[str] = []
        self.error: BaseException | None = None
        self.rc: int | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._started.wait(300)
        if self.error is not None:
            raise self.error

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self):
        try:
            self.server = Server(self.config, log=self.logs.append)
            await self.server.start()
        except BaseException as e:
            self.error = e
            self._started.set()
            return
        self._started.set()
        await self.server._stop.wait()
        self.rc = await self.server.shutdown()

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.server.ports['http']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.server.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.ports['metrics']}/metrics"

    def call(self, coro, timeout: float = 120):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> int | None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.stop)
            self.thread.join(120)
        return self.rc


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_model(root, "matmul", 1, matmul_model(), MATMUL_CONFIG)
    write_model(root, "fixed", 1, fixed_model())
    return root


@pytest.fixture(scope="module")
def served(repo):
    s = ServerThread(model_repository=str(repo), max_body_bytes=1 << 20)
    yield s
    s.stop()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts heavy machinery (Ray); minutes on 2 cores")
