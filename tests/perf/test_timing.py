"""kiln bench's measurement and summary, driven by a fake clock (no real timing asserted)."""

from __future__ import annotations

import io

import pytest

from kiln.perf.timing import Record, TimingConfig, measure, percentile, summarize


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def stub_engine(clock: FakeClock, latencies_ms: list[float]):
    """A 'run' whose k-th call takes latencies_ms[k % len] on the fake clock."""
    calls = {"n": 0}

    def run():
        clock.t += latencies_ms[calls["n"] % len(latencies_ms)] / 1e3
        calls["n"] += 1
    return run, calls


def test_bench_warmup_then_min_duration():
    clock = FakeClock()
    run, calls = stub_engine(clock, [15.625])  # 1/64 s: exact in binary floating point
    cfg = TimingConfig(warmup_s=0.25, min_iterations=10, min_duration_s=3.0)
    records, wall = measure([run], cfg, clock=clock)
    assert calls["n"] == 16 + 192  # 250 ms of warm-up runs, then 3 s of timed runs
    assert len(records) == 192 and wall == pytest.approx(3.0)


def test_bench_min_iterations_dominates_short_duration():
    clock = FakeClock()
    run, _ = stub_engine(clock, [125.0])
    records, wall = measure([run], TimingConfig(0.0, 25, 0.5), clock=clock)
    assert len(records) == 25 and wall == pytest.approx(3.125)


def test_bench_summary_fields_known_timings():
    lat = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    records, t = [], 0.0
    for x in lat:
        records.append(Record(0, t, t + x / 1e3))
        t += x / 1e3
    s = summarize(records, wall_s=t, items_per_query=8, percentiles=(50, 90, 99))
    assert s.queries == 10 and s.wall_s == pytest.approx(0.055)
    assert s.qps == pytest.approx(10 / 0.055) and s.items_per_s == pytest.approx(80 / 0.055)
    assert s.latency_ms["min"] == pytest.approx(1.0) and s.latency_ms["max"] == pytest.approx(10)
    assert s.latency_ms["mean"] == pytest.approx(5.5)
    assert s.latency_ms["median"] == pytest.approx(5.5)
    assert s.percentiles_ms == {"p50": pytest.approx(5.0), "p90": pytest.approx(9.0),
                                "p99": pytest.approx(10.0)}
    assert s.enqueue_ms is None
    assert any("unstable" in w for w in s.warnings)


def test_bench_stable_timing_has_no_warning():
    records = [Record(0, k * 1e-3, (k + 1) * 1e-3) for k in range(50)]
    s = summarize(records, 0.05, 1)
    assert s.cv == pytest.approx(0.0, abs=1e-9) and s.warnings == []


def test_bench_enqueue_bound_warning():
    records = [Record(0, k * 1e-3, (k + 1) * 1e-3, enqueue=0.95e-3) for k in range(20)]
    s = summarize(records, 0.02, 1)
    assert s.enqueue_ms["median"] == pytest.approx(0.95)
    assert any("enqueue" in w for w in s.warnings)


def test_bench_streams_count_all_queries():
    clock = FakeClock()  # threads share one fake clock: each call adds its latency
    runs = [stub_engine(clock, [5.0])[0] for _ in range(3)]
    records, wall = measure(runs, TimingConfig(0.0, 30, 0.1), clock=clock)
    assert {r.stream for r in records} == {0, 1, 2}
    assert len(records) >= 30


def test_bench_percentile_nearest_rank():
    v = sorted(float(x) for x in range(1, 101))
    assert percentile(v, 90) == 90.0 and percentile(v, 99) == 99.0 and percentile(v, 100) == 100


def test_bench_print_summary_mentions_everything():
    from kiln.cli.bench import print_summary

    records = [Record(0, k * 2e-3, (k + 1) * 2e-3) for k in range(10)]
    s = summarize(records, 0.02, 4)
    buf = io.StringIO()
    print_summary(s, "cpu", 1, {}, out=buf)
    text = buf.getvalue()
    for needle in ("Throughput: 500.00 qps, 2000.00 items/s", "median = 2.000 ms",
                   "percentile(99%)", "Total Host Walltime", "not applicable"):
        assert needle in text
