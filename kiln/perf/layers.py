"""Per-layer timing: a separate profiling run, so the timed run stays clean."""

from __future__ import annotations

import statistics


def profile_layers(engine, feeds_args: list, runs: int = 10) -> list[dict]:
    """Run the engine's steps ``runs`` times with a timer on each; one row per layer with
    total/average/median ms and its share of the total, slowest first."""
    ex = engine._executor
    times: list[list[float]] = [[] for _ in ex.steps]

    def timer(k, seconds):
        times[k].append(1e3 * seconds)

    ex.run(feeds_args)  # warm-up
    for _ in range(runs):
        ex.run(feeds_args, timer=timer)
    grand = sum(sum(t) for t in times) or 1.0
    rows = [{"name": st.node.name, "op": st.node.op.name, "total_ms": sum(t),
             "avg_ms": sum(t) / len(t), "median_ms": statistics.median(t),
             "percent": 100.0 * sum(t) / grand}
            for st, t in zip(ex.steps, times) if t]
    rows.sort(key=lambda r: -r["total_ms"])
    return rows
