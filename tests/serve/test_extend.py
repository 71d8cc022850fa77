"""The hook other parts of kiln use: extra FastAPI routers on the HTTP app (as the OpenAI
routes will be), reaching the server, and metrics in the shared registry on /metrics."""

from __future__ import annotations

import json
import urllib.request

from fastapi import APIRouter, Request
from prometheus_client import Counter

from kiln.cli.serve import load_router
from tests.serve.conftest import ServerThread

router = APIRouter()


@router.get("/v1/ping")
async def ping(request: Request):
    server = request.app.state.server
    counter = getattr(server, "_ping_counter", None)
    if counter is None:
        counter = server._ping_counter = Counter("kiln_test_pings", "pings",
                                                 registry=server.metrics.registry)
    counter.inc()
    return {"models": sorted(server.models.models), "ready": server.ready()}


def test_extra_router_mounted_and_metrics_shared(tmp_path):
    assert load_router("tests.serve.test_extend:router") is router
    s = ServerThread(model_repository=str(tmp_path), extra_routers=(router,), grpc_port=None)
    try:
        with urllib.request.urlopen(f"http://{s.http}/v1/ping", timeout=30) as r:
            assert json.load(r) == {"models": [], "ready": True}
        with urllib.request.urlopen(f"http://{s.http}/v2/health/ready", timeout=30) as r:
            assert r.status == 200  # the v2 routes are still there
        text = urllib.request.urlopen(s.metrics_url, timeout=30).read().decode()
        assert "kiln_test_pings_total 1.0" in text
        assert "# TYPE nv_inference_request_success counter" in text
    finally:
        s.stop()
