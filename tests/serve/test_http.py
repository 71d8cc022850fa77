"""KServe v2 over HTTP against a real server, with the real tritonclient (binary data by
default, JSON on request) and raw requests for malformed input."""

from __future__ import annotations

import gzip
import http.client
import json
import struct
import urllib.request

import numpy as np
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from tests.serve.conftest import expected

# tritonclient closes its gevent pool in __del__, which fails when the GC runs it on the
# server's thread: harmless, and not ours
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

@pytest.fixture
def client(served):
    c = th.InferenceServerClient(served.http)
    yield c
    c.close()


def post(served, path: str, body: bytes, headers=None) -> tuple[int, dict, bytes]:
    host, port = served.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


def infer_json(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}]}).encode()


def test_http_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("matmul") and client.is_model_ready("matmul", "1")
    meta = client.get_model_metadata("matmul")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["versions"] == ["1"]
    assert client.get_server_metadata()["name"] == "kiln"
    cfg = client.get_model_config("fixed")
    assert cfg["input"][0]["name"] == "a" and cfg.get("max_batch_size", 0) == 0


def test_http_infer_binary_default(client):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    i = th.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    r = client.infer("matmul", [i])
    np.testing.assert_allclose(r.as_numpy("y"), expected(x), rtol=1e-5, atol=1e-5)
    assert r.get_response()["model_version"] == "1"


def test_http_infer_json_both_ways(client):
    a = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    b = np.ones((2, 3), np.float32)
    ins = [th.InferInput("a", [2, 3], "FP32"), th.InferInput("b", [2, 3], "FP32")]
    ins[0].set_data_from_numpy(a, binary_data=False)
    ins[1].set_data_from_numpy(b, binary_data=False)
    out = th.InferRequestedOutput("z", binary_data=False)
    r = client.infer("fixed", ins, outputs=[out], request_id="req-7")
    assert r.get_response()["id"] == "req-7"
    assert "data" in r.get_response()["outputs"][0]
    np.testing.assert_array_equal(r.as_numpy("z"), np.maximum(a, 0) + b)


def test_http_infer_gzip_request_and_response(client):
    x = np.ones((2, 4), np.float32)
    i = th.InferInput("x", [2, 4], "FP32")
    i.set_data_from_numpy(x)
    r = client.infer("matmul", [i], request_compression_algorithm="gzip",
                     response_compression_algorithm="gzip")
    np.testing.assert_allclose(r.as_numpy("y"), expected(x))


def test_http_stats_and_index(client):
    x = np.ones((1, 4), np.float32)
    i = th.InferInput("x", [1, 4], "FP32")
    i.set_data_from_numpy(x)
    client.infer("matmul", [i])
    st = client.get_inference_statistics("matmul")["model_stats"][0]
    assert st["name"] == "matmul" and st["inference_stats"]["success"]["count"] >= 1
    index = client.get_model_repository_index()
    assert {(e["name"], e["state"]) for e in index} >= {("matmul", "READY"), ("fixed", "READY")}


def test_http_unknown_model_is_404_and_named(served, client):
    status, _, body = post(served, "/v2/models/nope/infer", infer_json(np.ones((1, 4))))
    assert status == 404 and "unknown model 'nope'" in json.loads(body)["error"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")


def nested(depth: int):
    x = [1.0]
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object with an 'inputs' list"),
    (b"[" * 100 + b"]" * 100, "nested deeper"),
    (json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                             "data": nested(70)}]}).encode(), "nested deeper"),
])
def test_http_bad_json_is_400(served, client, body, needle):
    status, _, data = post(served, "/v2/models/matmul/infer", body)
    assert status == 400 and needle in json.loads(data)["error"]
    assert client.is_server_ready()  # and the server keeps serving


def test_http_wrong_dtype_and_shape_are_400(served):
    status, _, data = post(served, "/v2/models/matmul/infer", json.dumps({"inputs": [
        {"name": "x", "datatype": "FP64", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode())
    assert status == 400 and "datatype FP64, but the model takes FP32" in json.loads(data)["error"]
    status, _, data = post(served, "/v2/models/matmul/infer", infer_json(np.ones((1, 5))))
    assert status == 400 and "shape [1, 5]" in json.loads(data)["error"]
    status, _, data = post(served, "/v2/models/matmul/infer", infer_json(np.ones((9, 4))))
    assert status == 400 and "max_batch_size" in json.loads(data)["error"]
    status, _, data = post(served, "/v2/models/matmul/infer", json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2]}]}).encode())
    assert status == 400 and "2 values for shape [1, 4]" in json.loads(data)["error"]
    status, _, data = post(served, "/v2/models/matmul/infer", json.dumps({"inputs": [
        {"name": "q", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}).encode())
    assert status == 400 and "no input 'q'" in json.loads(data)["error"]


def test_http_shape_overflow_is_400(served):
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32",
                                   "shape": [2**40, 2**40],
                                   "parameters": {"binary_data_size": 16}}]}).encode()
    status, _, data = post(served, "/v2/models/matmul/infer", head + bytes(16),
                           {"Inference-Header-Content-Length": str(len(head))})
    assert status == 400 and "more than" in json.loads(data)["error"]
    status, _, data = post(served, "/v2/models/matmul/infer", json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, 4], "data": []}]}).encode())
    assert status == 400 and "non-negative" in json.loads(data)["error"]


def test_http_binary_size_mismatch_is_400(served):
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                   "parameters": {"binary_data_size": 12}}]}).encode()
    status, _, data = post(served, "/v2/models/matmul/infer", head + bytes(12),
                           {"Inference-Header-Content-Length": str(len(head))})
    assert status == 400 and "12 bytes of data for shape [1, 4]" in json.loads(data)["error"]


def test_http_oversized_body_is_413_and_server_keeps_serving(served, client):
    big = bytes(2 << 20)  # over the fixture's 1 MiB limit
    status, _, data = post(served, "/v2/models/matmul/infer", big)
    assert status == 413 and "limit" in json.loads(data)["error"]
    bomb = gzip.compress(b" " * (4 << 20))  # small on the wire, 4 MiB decompressed
    assert len(bomb) < 1 << 20
    status, _, data = post(served, "/v2/models/matmul/infer", bomb,
                           {"Content-Encoding": "gzip"})
    assert status == 413 and "decompressed" in json.loads(data)["error"]
    test_http_infer_binary_default(client)


def test_http_unknown_route_is_404_json(served):
    status, _, data = post(served, "/v2/nothing", b"")
    assert status == 404 and "error" in json.loads(data)


def test_http_bytes_wire_format_round_trip():
    from kiln.serve import datatypes

    arr = np.array([b"ab", b"", "\u00e9".encode()], dtype=object)
    raw = datatypes.to_raw(arr)
    assert raw[:4] == struct.pack("<I", 2)
    back = datatypes.from_raw(raw, "BYTES", (3,), "t")
    assert list(back) == list(arr)
    with pytest.raises(Exception, match="runs past"):
        datatypes.from_raw(raw[:-1], "BYTES", (3,), "t")


def test_http_metrics_counts_requests(served, client):
    def scrape():
        return urllib.request.urlopen(served.metrics_url, timeout=30).read().decode()

    def value(text, name, **labels):
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}}"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = scrape()
    x = np.ones((2, 4), np.float32)
    for _ in range(3):
        i = th.InferInput("x", [2, 4], "FP32")
        i.set_data_from_numpy(x)
        client.infer("matmul", [i])
    post(served, "/v2/models/matmul/infer", infer_json(np.ones((1, 5))))  # fails: bad shape
    after = scrape()
    lab = {"model": "matmul", "version": "1"}
    assert value(after, "nv_inference_request_success", **lab) - value(
        before, "nv_inference_request_success", **lab) == 3
    assert value(after, "nv_inference_count", **lab) - value(
        before, "nv_inference_count", **lab) == 6
    assert value(after, "nv_inference_request_failure", **lab, reason="OTHER") - value(
        before, "nv_inference_request_failure", **lab, reason="OTHER") == 1
    assert "# TYPE nv_inference_exec_count counter" in after
    assert "nv_inference_pending_request_count" in after
    assert 'kiln_inference_batch_size_bucket{le="2.0",model="matmul",version="1"}' in after
