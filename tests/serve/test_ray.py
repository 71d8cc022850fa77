"""kiln replicas under a real local Ray Serve, reached by tritonclient over loopback."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest

from tests.serve.conftest import MATMUL_CONFIG, expected, matmul_model, write_model

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(serve, attempts: int = 4) -> int:
    """Start Ray Serve's HTTP proxy on a free loopback port and return the port.

    A port free when asked can be taken before the proxy binds it (Ray's own
    workers open ports as they start), so a failed bind is retried on a new one.
    """
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:  # Ray wraps the bind error in a RayTaskError
            if "Failed to bind" not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def test_ray_serve_two_kiln_replicas(tmp_path):
    import tritonclient.http as th
    from ray import serve

    from kiln.serve.ray import deployment

    write_model(tmp_path, "matmul", 1, matmul_model(), MATMUL_CONFIG)
    root = str(Path(__file__).resolve().parents[2])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root + os.pathsep +
                                       os.environ.get("PYTHONPATH", "")}})
    try:
        port = start_serve(serve)
        serve.run(deployment(str(tmp_path), num_replicas=2), name="kiln", route_prefix="/")
        c = th.InferenceServerClient(f"127.0.0.1:{port}")
        assert c.is_server_ready() and c.is_model_ready("matmul")
        rng = np.random.default_rng(0)
        for _ in range(20):
            x = rng.standard_normal((2, 4)).astype(np.float32)
            i = th.InferInput("x", [2, 4], "FP32")
            i.set_data_from_numpy(x)
            y = c.infer("matmul", [i]).as_numpy("y")
            np.testing.assert_allclose(y, expected(x), rtol=1e-5, atol=1e-5)
        status = serve.status().applications["kiln"].deployments["KilnReplica"]
        assert status.replica_states.get("RUNNING") == 2
        c.close()
    finally:
        serve.shutdown()
        ray.shutdown()
