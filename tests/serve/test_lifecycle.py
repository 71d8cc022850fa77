"""Model control and server lifecycle against real servers: explicit load/unload, readiness,
reload under load with zero failed requests, bad configs refused with file/field/reason,
a full queue answered 503/UNAVAILABLE at once, and SIGTERM drain (exit 1 when it cuts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from tests.serve.conftest import (
    MATMUL_CONFIG,
    ServerThread,
    expected,
    fixed_model,
    matmul_model,
    write_model,
)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def infer(client, rows=1, model="matmul"):
    x = np.ones((rows, 4), np.float32)
    i = th.InferInput("x", [rows, 4], "FP32")
    i.set_data_from_numpy(x)
    return client.infer(model, [i]).as_numpy("y")


class Gate:
    """Wraps an instance: each run waits until the test opens the gate."""

    def __init__(self, inner):
        self.inner, self.open, self.entered = inner, threading.Event(), threading.Event()

    def run(self, feeds):
        self.entered.set()
        self.open.wait(60)
        return self.inner.run(feeds)


def gate_model(server: ServerThread, name: str) -> Gate:
    async def swap():
        sched = server.server.models.get(name).scheduler
        gate = Gate(sched.free[0])
        sched.free = [gate]
        return gate
    return server.call(swap())


def test_explicit_load_unload_and_readiness(tmp_path):
    write_model(tmp_path, "matmul", 1, matmul_model(), MATMUL_CONFIG)
    s = ServerThread(model_repository=str(tmp_path), model_control_mode="explicit",
                     grpc_port=None)
    try:
        c = th.InferenceServerClient(s.http)
        assert c.is_server_live()
        assert not c.is_model_ready("matmul")
        c.load_model("matmul")
        assert c.is_model_ready("matmul") and c.is_server_ready()
        np.testing.assert_allclose(infer(c), expected(np.ones((1, 4), np.float32)))
        c.unload_model("matmul")
        assert not c.is_model_ready("matmul")
        with pytest.raises(InferenceServerException, match="no ready version"):
            infer(c)
        with pytest.raises(InferenceServerException, match="failed to load 'absent'"):
            c.load_model("absent")
        c.close()
    finally:
        s.stop()


def test_bad_config_refused_with_file_field_reason(tmp_path):
    write_model(tmp_path, "matmul", 1, matmul_model(), MATMUL_CONFIG)
    write_model(tmp_path, "bad", 1, matmul_model(), "max_batch_size: 4\ndynamic_batching { "
                "preferred_batch_size: [ 16 ] }\n")
    write_model(tmp_path, "typo", 1, matmul_model(), "max_batch_sise: 4\n")
    write_model(tmp_path, "wrongtype", 1, matmul_model(),
                'max_batch_size: 4\ninput [ { name: "x" data_type: TYPE_INT32 dims: [ 4 ] } ]\n')
    s = ServerThread(model_repository=str(tmp_path), grpc_port=None)
    try:
        c = th.InferenceServerClient(s.http)
        assert not c.is_server_ready()  # strict readiness: a model failed to load
        assert c.is_model_ready("matmul") and infer(c).shape == (1, 4)
        reasons = {e["name"]: e.get("reason", "") for e in c.get_model_repository_index()}
        cfg = str(tmp_path / "bad" / "config.pbtxt")
        assert reasons["bad"].startswith(cfg) and "preferred_batch_size" in reasons["bad"] \
            and "outside 1..max_batch_size" in reasons["bad"]
        assert "line 1" in reasons["typo"] and "max_batch_sise" in reasons["typo"]
        assert "input[0].data_type" in reasons["wrongtype"] and "TYPE_FP32" in \
            reasons["wrongtype"]
        c.close()
    finally:
        s.stop()


def test_reload_under_load_fails_no_request(tmp_path):
    write_model(tmp_path, "matmul", 1, matmul_model(1.0), MATMUL_CONFIG)
    s = ServerThread(model_repository=str(tmp_path), model_control_mode="poll",
                     poll_interval=3600, grpc_port=None)
    stop, failures, seen = threading.Event(), [], []

    def load():
        c = th.InferenceServerClient(s.http)
        while not stop.is_set():
            try:
                y = infer(c)
                seen.append(float(y[0, 0]) / float(expected(np.ones((1, 4)))[0, 0]))
            except Exception as e:  # counted: the test wants none
                failures.append(repr(e))
        c.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        write_model(tmp_path, "matmul", 2, matmul_model(2.0))  # a new version: latest wins
        s.call(s.server.poll_once())
        n_v2 = len(seen)
        time.sleep(0.5)
        n_before_v3 = len(seen)  # (answers during the next poll may come from either engine)
        write_model(tmp_path, "matmul", 2, matmul_model(3.0))  # the same version, changed
        s.call(s.server.poll_once())
        n_v3 = len(seen)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        s.stop()
    assert failures == []
    assert seen[0] == 1.0 and set(seen) <= {1.0, 2.0, 3.0}
    assert set(seen[n_v2:n_before_v3]) <= {1.0, 2.0} and 2.0 in seen  # v1 drains, v2 takes over
    assert set(seen[n_v3 + 8:]) == {3.0}  # after the in-place change only the new engine


def test_queue_full_is_503_and_unavailable(tmp_path):
    write_model(tmp_path, "matmul", 1, matmul_model(), "max_batch_size: 1\ndynamic_batching {"
                " default_queue_policy { max_queue_size: 1 } }\n")
    s = ServerThread(model_repository=str(tmp_path))
    try:
        gate = gate_model(s, "matmul")
        results = []
        workers = [threading.Thread(target=lambda: results.append(
            infer(th.InferenceServerClient(s.http)))) for _ in range(2)]
        workers[0].start()
        assert gate.entered.wait(60)  # one runs ...
        workers[1].start()
        time.sleep(0.3)  # ... one waits in the queue
        c = th.InferenceServerClient(s.http)
        with pytest.raises(InferenceServerException) as e:
            infer(c)
        assert e.value.status() == "503" and "retry later" in str(e.value)
        g = tg.InferenceServerClient(s.grpc)
        i = tg.InferInput("x", [1, 4], "FP32")
        i.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException) as e:
            g.infer("matmul", [i])
        assert e.value.status() == "StatusCode.UNAVAILABLE"
        gate.open.set()
        for w in workers:
            w.join(60)
        assert len(results) == 2  # the two accepted requests were answered
        assert "REJECTED" in open_metrics(s)
    finally:
        s.stop()


def open_metrics(s) -> str:
    import urllib.request

    return urllib.request.urlopen(s.metrics_url, timeout=30).read().decode()


@pytest.mark.parametrize("release, rc", [(True, 0), (False, 1)])
def test_shutdown_drains_in_flight(tmp_path, release, rc):
    write_model(tmp_path, "fixed", 1, fixed_model())
    s = ServerThread(model_repository=str(tmp_path), grace_period=1.5, grpc_port=None)
    gate = gate_model(s, "fixed")
    got = []

    def one():
        c = th.InferenceServerClient(s.http, network_timeout=60)
        ins = [th.InferInput(n, [2, 3], "FP32") for n in "ab"]
        for i in ins:
            i.set_data_from_numpy(np.ones((2, 3), np.float32))
        try:
            got.append(c.infer("fixed", ins).as_numpy("z"))
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=one)
    t.start()
    assert gate.entered.wait(60)
    s.loop.call_soon_threadsafe(s.server.stop)
    time.sleep(0.3)
    assert not s.server.ready()  # draining: not ready, still answering what it holds
    if release:
        gate.open.set()
    assert s.stop() == rc
    gate.open.set()
    t.join(60)
    if release:
        np.testing.assert_array_equal(got[0], np.full((2, 3), 2, np.float32))
    else:
        assert isinstance(got[0], Exception)


def test_cli_serve_sigterm_exits_zero(tmp_path):
    write_model(tmp_path, "fixed", 1, fixed_model())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "--model-repository",
                          str(tmp_path), "--host", "127.0.0.1", "--http-port", "0",
                          "--grpc-port", "0", "--metrics-port", "0"],
                         stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = p.stderr.readline()
        lines.append(line)
        if "listening" in line or not line:
            break
    assert "listening" in lines[-1], "".join(lines)
    p.send_signal(signal.SIGTERM)
    out = p.stderr.read()
    assert p.wait(60) == 0, out
    assert "every request answered" in out


def test_request_timeout_is_504_and_server_recovers(tmp_path):
    write_model(tmp_path, "matmul", 1, matmul_model(), MATMUL_CONFIG)
    s = ServerThread(model_repository=str(tmp_path), request_timeout=0.5, grpc_port=None)
    try:
        gate = gate_model(s, "matmul")
        c = th.InferenceServerClient(s.http)
        with pytest.raises(InferenceServerException) as e:
            infer(c)  # its batch hangs behind the gate past the request timeout
        assert e.value.status() == "504" and "request timeout" in str(e.value)
        gate.open.set()
        np.testing.assert_allclose(infer(c), expected(np.ones((1, 4), np.float32)))
        c.close()
    finally:
        s.stop()


def test_poll_mode_loads_new_and_unloads_removed_models(tmp_path):
    import shutil

    write_model(tmp_path, "fixed", 1, fixed_model())
    s = ServerThread(model_repository=str(tmp_path), model_control_mode="poll",
                     poll_interval=0.2, grpc_port=None)
    try:
        c = th.InferenceServerClient(s.http)
        assert c.is_model_ready("fixed")
        write_model(tmp_path, "matmul", 1, matmul_model(), MATMUL_CONFIG)
        deadline = time.time() + 120
        while time.time() < deadline and not c.is_model_ready("matmul"):
            time.sleep(0.2)
        assert c.is_model_ready("matmul")  # the poll loop found and loaded it
        shutil.rmtree(tmp_path / "fixed")
        while time.time() < deadline and c.is_model_ready("fixed"):
            time.sleep(0.2)
        assert not c.is_model_ready("fixed") and c.is_server_ready()
        c.close()
    finally:
        s.stop()
