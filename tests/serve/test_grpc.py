"""KServe v2 over gRPC against a real server with the real tritonclient.grpc; the .proto's
field numbers against tritonclient's own descriptors."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import model_config_pb2 as triton_mc
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from kiln.serve.proto import grpc_service_pb2, model_config_pb2
from tests.serve.conftest import expected

# tritonclient closes its gevent pool in __del__, which fails when the GC runs it on the
# server's thread: harmless, and not ours
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

@pytest.fixture
def client(served):
    c = tg.InferenceServerClient(served.grpc)
    yield c
    c.close()


def test_grpc_health_metadata_config(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("matmul")
    meta = client.get_model_metadata("matmul", as_json=True)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    cfg = client.get_model_config("matmul").config
    assert cfg.max_batch_size == 8 and cfg.dynamic_batching.max_queue_delay_microseconds == 2000
    assert cfg.input[0].data_type == triton_mc.TYPE_FP32
    assert client.get_server_metadata().name == "kiln"


def test_grpc_infer(client):
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    i = tg.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    r = client.infer("matmul", [i], outputs=[tg.InferRequestedOutput("y")], request_id="g1")
    np.testing.assert_allclose(r.as_numpy("y"), expected(x), rtol=1e-5, atol=1e-5)
    assert r.get_response().id == "g1"


def test_grpc_typed_contents(served):
    # a request with typed contents (not raw_input_contents), built from tritonclient's stubs
    ch = grpc.insecure_channel(served.grpc)
    stub = tg.service_pb2_grpc.GRPCInferenceServiceStub(ch)
    req = triton_pb.ModelInferRequest(model_name="fixed")
    for name, vals in (("a", [-1.0, 2, -3, 4, -5, 6]), ("b", [1.0] * 6)):
        t = req.inputs.add(name=name, datatype="FP32", shape=[2, 3])
        t.contents.fp32_contents.extend(vals)
    resp = stub.ModelInfer(req)
    z = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(2, 3)
    np.testing.assert_array_equal(z, [[1, 3, 1], [5, 1, 7]])
    ch.close()


def test_grpc_errors_carry_codes(client):
    x = np.ones((1, 5), np.float32)
    i = tg.InferInput("x", [1, 5], "FP32")
    i.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as e:
        client.infer("matmul", [i])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "shape [1, 5]" in str(e.value)
    with pytest.raises(InferenceServerException) as e:
        client.infer("nope", [i])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert client.is_server_ready()


def test_grpc_stats_and_index(client):
    x = np.ones((1, 4), np.float32)
    i = tg.InferInput("x", [1, 4], "FP32")
    i.set_data_from_numpy(x)
    client.infer("matmul", [i])
    st = client.get_inference_statistics("matmul").model_stats[0]
    assert st.name == "matmul" and st.execution_count >= 1
    names = {m.name for m in client.get_model_repository_index().models}
    assert {"matmul", "fixed"} <= names


def _compare(mine, theirs, where=""):
    for f in mine.fields:
        t = theirs.fields_by_name.get(f.name)
        assert t is not None, f"{where}{mine.name}.{f.name} is not in tritonclient's proto"
        assert (f.number, f.type, f.is_repeated) == (t.number, t.type, t.is_repeated), \
            f"{where}{mine.name}.{f.name} differs from tritonclient's"
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            _compare(f.message_type, t.message_type, f"{where}{mine.name}.")


@pytest.mark.parametrize("mine, theirs", [(grpc_service_pb2, triton_pb),
                                          (model_config_pb2, triton_mc)])
def test_grpc_proto_matches_tritonclient_wire_format(mine, theirs):
    for name, d in mine.DESCRIPTOR.message_types_by_name.items():
        _compare(d, theirs.DESCRIPTOR.message_types_by_name[name])
    for name, e in mine.DESCRIPTOR.enum_types_by_name.items():
        t = theirs.DESCRIPTOR.enum_types_by_name[name]
        assert {v.name: v.number for v in e.values}.items() <= \
            {v.name: v.number for v in t.values}.items()


def test_grpc_service_methods_are_tritons():
    mine = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for m in mine.methods:
        t = theirs.methods_by_name[m.name]
        assert (m.input_type.name, m.output_type.name) == (t.input_type.name, t.output_type.name)
