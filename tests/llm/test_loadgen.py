import pytest

from kiln.llm.loadgen import RequestResult, summarize


def test_summary_follows_vllm_bench_definitions():
    a = RequestResult(ok=True, ttft=0.1, itl=[0.02, 0.03], e2e=0.15, prompt_tokens=10,
                      output_tokens=3)
    b = RequestResult(ok=True, ttft=0.3, itl=[0.05], e2e=0.35, prompt_tokens=20,
                      output_tokens=2)
    bad = RequestResult(ok=False, error="HTTP 500")
    s = summarize([a, b, bad], duration=2.0, slo={"ttft": 200})
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert a.tpot == pytest.approx(0.025) and b.tpot == pytest.approx(0.05)
    assert s["mean_tpot_ms"] == pytest.approx(37.5)
    assert s["mean_itl_ms"] == pytest.approx(100 / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["goodput"] == pytest.approx(0.5)  # only a meets TTFT <= 200 ms
