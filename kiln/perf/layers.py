"""Per-layer timing: a separate profiling run, so the timed run stays clean."""

from __future__ import annotations

import statistics


def profile_layers(engine, feeds_args: list, runs: int = 10) -> list[dict]:
    """Run the engine's steps ``runs`` times with a timer on each; one row per layer with
    total/average/median ms, its share of the total and the CPU tactic it runs (see
    :func:`picked_tactic`), slowest first."""
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
             "percent": 100.0 * sum(t) / grand, "tactic": picked_tactic(st.call)}
            for st, t in zip(ex.steps, times) if t]
    rows.sort(key=lambda r: -r["total_ms"])
    return rows


def picked_tactic(call) -> str:
    """The tactic a CPU kernel picked on its first run (per input shape; several are joined by
    commas): ``kiln``, ``onednn``, ``mkl``, ... for GEMMs and convolutions, '' for the rest."""
    cache = getattr(call, "cache", None) or {}
    names = {t for key in ("conv_tactics", "lin_tactics") for t in cache.get(key, {}).values()}
    return ",".join(sorted(names))
