"""The HTTP routes over loopback with the real openai client (tiny random Llama)."""

import json
import urllib.request

import openai
import pytest

from kiln.llm.engine import EngineConfig, LLMEngine
from kiln.llm.server import BackgroundServer


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = BackgroundServer.start(LLMEngine(tiny_dir, EngineConfig(num_blocks=128)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(client, prompt, n=12, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama0"]
    r = greedy(client, "The capital of France is")
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == 17 and r.choices[0].text


def test_stream_equals_non_stream_with_usage(client):
    full = greedy(client, "Once upon a time").choices[0].text
    chunks = list(greedy(client, "Once upon a time", stream=True,
                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) <= {None}


def test_stop_string_across_chunks(client):
    full = greedy(client, "Hello", n=16).choices[0].text
    stop = full[5:9]  # four characters from the middle: likely several tokens
    assert stop and stop in full
    chunks = list(greedy(client, "Hello", n=16, stream=True, stop=[stop]))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = greedy(client, "Hello", n=16, stop=[stop])
    assert r.choices[0].text == text and r.choices[0].finish_reason == "stop"


def test_several_prompts_in_one_request(client):
    one = [greedy(client, p, n=6).choices[0].text for p in ("a b c", "x y z")]
    both = greedy(client, ["a b c", "x y z"], n=6)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == one


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8 == r.usage.completion_tokens


def test_bad_requests_get_400(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="x", top_p=3.0)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", logprobs=2)
    with pytest.raises(openai.BadRequestError, match="does not fit the model length 512"):
        client.completions.create(model="tiny", prompt="x " * 600, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return r.read().decode()


def test_v2_generate_and_metrics(server, client):
    p = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body = {"text_input": "The capital of France is", "parameters": p}
    out = json.loads(_post(server.url + "/v2/models/tiny-llama0/generate", body))
    ref = greedy(client, "The capital of France is", n=6).choices[0].text
    assert out["text_output"] == ref and out["finish_reason"] == "length"
    events = [json.loads(line[6:]) for line in
              _post(server.url + "/v2/models/tiny-llama0/generate_stream", body).splitlines()
              if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == ref
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds",
                 "inter_token_latency_seconds", "generation_tokens_total",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "generation_tokens_per_second"):
        assert "kiln_llm_" + name in text
    count = [ln for ln in text.splitlines()
             if ln.startswith("kiln_llm_time_to_first_token_seconds_count")]
    assert float(count[0].split()[-1]) >= 2


def test_bad_prompt_in_a_list_queues_nothing(server, client):
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        client.completions.create(model="tiny", prompt=["fine", "x " * 600], max_tokens=4)
    assert server.llm.engine.scheduler.requests == {}
