"""`kiln serve --llm`: the OpenAI routes and the KServe v2 routes on ONE server, each with its
real client (openai; tritonclient HTTP and gRPC) over loopback."""

from __future__ import annotations

import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th

from kiln.llm import LLM, SamplingParams
from kiln.llm.engine import EngineConfig
from tests.llm.conftest import make_tiny_dir
from tests.serve.conftest import MATMUL_CONFIG, ServerThread, expected, matmul_model, write_model

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("llm"))


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_dir):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "matmul", 1, matmul_model(), MATMUL_CONFIG)
    s = ServerThread(model_repository=str(repo), llm=str(tiny_dir), llm_name="tiny",
                     llm_engine=EngineConfig(num_blocks=64))
    yield s
    assert s.stop() == 0


def test_openai_and_triton_clients_on_one_server(both, tiny_dir):
    oa = openai.OpenAI(base_url=f"http://{both.http}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    r = oa.completions.create(model="tiny", prompt="The capital of France is", max_tokens=6,
                              temperature=0, extra_body={"ignore_eos": True})
    ref = LLM(tiny_dir, num_blocks=16).generate(
        ["The capital of France is"], SamplingParams(max_tokens=6, temperature=0,
                                                     ignore_eos=True))[0].outputs[0].text
    assert r.choices[0].text == ref and r.usage.completion_tokens == 6
    chunks = list(oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    hc = th.InferenceServerClient(both.http)
    try:
        assert hc.is_server_ready() and hc.is_model_ready("matmul")
        i = th.InferInput("x", [2, 4], "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_allclose(hc.infer("matmul", [i]).as_numpy("y"), expected(x),
                                   rtol=1e-5, atol=1e-5)
    finally:
        hc.close()
    gc = tg.InferenceServerClient(both.grpc)
    try:
        i = tg.InferInput("x", [2, 4], "FP32")
        i.set_data_from_numpy(x)
        np.testing.assert_allclose(gc.infer("matmul", [i]).as_numpy("y"), expected(x),
                                   rtol=1e-5, atol=1e-5)
    finally:
        gc.close()

    text = urllib.request.urlopen(both.metrics_url, timeout=30).read().decode()
    assert 'nv_inference_request_success{model="matmul",version="1"} 2' in text
    assert "kiln_llm_generation_tokens_total 10.0" in text
    assert any("LLM 'tiny'" in line for line in both.logs)


def test_bad_llm_path_fails_the_start(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        ServerThread(model_repository=str(tmp_path), llm=str(tmp_path / "nope.gguf"),
                     grpc_port=None)
