"""Timing loops and their summary, in the manner of trtexec.

Every function takes the clock as an argument so tests can drive it with a fake one; nothing
here asserts or decides on speed.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

CV_WARN = 0.025  # coefficient of variation above which timing is called unstable


@dataclass
class TimingConfig:
    warmup_s: float = 0.2
    min_iterations: int = 10
    min_duration_s: float = 3.0
    streams: int = 1
    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)


@dataclass
class Record:
    stream: int
    start: float  # seconds since the timed run began
    end: float
    enqueue: float | None = None  # seconds spent issuing work (CUDA); None on the CPU

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class Summary:
    queries: int
    wall_s: float
    items_per_query: int
    latency_ms: dict[str, float]
    percentiles_ms: dict[str, float]
    enqueue_ms: dict[str, float] | None
    cv: float
    warnings: list[str] = field(default_factory=list)

    @property
    def qps(self) -> float:
        return self.queries / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def items_per_s(self) -> float:
        return self.qps * self.items_per_query

    def to_json(self) -> dict:
        return {"queries": self.queries, "wall_s": self.wall_s, "qps": self.qps,
                "items_per_s": self.items_per_s, "items_per_query": self.items_per_query,
                "latency_ms": self.latency_ms, "percentiles_ms": self.percentiles_ms,
                "enqueue_ms": self.enqueue_ms, "cv": self.cv, "warnings": self.warnings}


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (as trtexec reports them)."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, int(-(-p * len(sorted_values) // 100)) - 1))
    return sorted_values[k]


def summarize(records: list[Record], wall_s: float, items_per_query: int,
              percentiles=(90.0, 95.0, 99.0)) -> Summary:
    lat = sorted(1e3 * r.latency for r in records)
    mean = statistics.fmean(lat)
    cv = statistics.pstdev(lat) / mean if len(lat) > 1 and mean > 0 else 0.0
    stats = {"min": lat[0], "max": lat[-1], "mean": mean, "median": statistics.median(lat)}
    pct = {f"p{p:g}": percentile(lat, p) for p in percentiles}
    enq = None
    if all(r.enqueue is not None for r in records):
        e = sorted(1e3 * r.enqueue for r in records)
        enq = {"min": e[0], "max": e[-1], "mean": statistics.fmean(e),
               "median": statistics.median(e)}
    s = Summary(len(records), wall_s, items_per_query, stats, pct, enq, cv)
    if cv > CV_WARN:
        s.warnings.append(f"latency is unstable: coefficient of variation {100 * cv:.1f}% is "
                          f"above {100 * CV_WARN:.1f}%; close other programs or run longer")
    if enq is not None and enq["median"] >= 0.8 * stats["median"]:
        s.warnings.append("throughput may be bound by enqueue time (the host issues work "
                          "about as slowly as the device runs it); try CUDA graphs")
    return s


def measure(run_fns: list[Callable[[], object]], cfg: TimingConfig,
            clock: Callable[[], float] = time.perf_counter,
            progress: Callable[[float], None] | None = None) -> tuple[list[Record], float]:
    """Warm up, then run every stream's function until both the iteration count and the
    duration are reached. Returns the records and the wall time of the timed part."""
    t0 = clock()
    while clock() - t0 < cfg.warmup_s:
        for fn in run_fns:
            fn()
    records: list[Record] = []
    lock = threading.Lock()
    start = clock()
    per_stream = max(1, -(-cfg.min_iterations // len(run_fns)))

    def loop(k: int, fn):
        n = 0
        while True:
            a = clock()
            fn()
            b = clock()
            n += 1
            with lock:
                records.append(Record(k, a - start, b - start))
            if k == 0 and progress is not None:
                progress(min(1.0, (b - start) / max(cfg.min_duration_s, 1e-9)))
            if n >= per_stream and b - start >= cfg.min_duration_s:
                return

    if len(run_fns) == 1:
        loop(0, run_fns[0])
    else:
        threads = [threading.Thread(target=loop, args=(k, fn)) for k, fn in enumerate(run_fns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = max(r.end for r in records)
    records.sort(key=lambda r: r.start)
    return records, wall
