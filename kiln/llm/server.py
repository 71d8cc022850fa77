"""The LLM HTTP server on a background thread (uvicorn on loopback): for tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import time

from kiln.errors import KilnError


class BackgroundServer:
    def __init__(self, llm, app, host: str, port: int):
        import uvicorn

        self.llm, self.host, self.port = llm, host, port
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @classmethod
    def start(cls, model, config=None, host: str = "127.0.0.1", port: int = 0):
        """Load ``model`` (path or LLMEngine) and serve it; returns once it accepts requests."""
        from kiln.llm.api import create_app
        from kiln.llm.async_engine import AsyncLLM
        from kiln.llm.engine import LLMEngine

        engine = model if isinstance(model, LLMEngine) else LLMEngine(model, config)
        llm = AsyncLLM(engine)
        s = cls(llm, create_app(llm), host, port or _free_port(host))
        s.thread.start()
        deadline = time.monotonic() + 30
        while not s.server.started:
            if not s.thread.is_alive() or time.monotonic() > deadline:
                raise KilnError(f"the LLM server did not start on {s.url}")
            time.sleep(0.02)
        return s

    def peak_memory_mib(self) -> float:
        import torch

        if self.llm.engine.model.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.llm.shutdown()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
