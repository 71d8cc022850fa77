"""Shared pieces of the corpus runner: the error measure, interleaved timing, failure text."""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}  # max rel err per output, against onnxruntime FP32


def rel_err(out, ref) -> float:
    """max|out - ref| / max|ref| (inf when the shapes differ, nan-safe)."""
    a = np.asarray(out, dtype=np.float64)
    b = np.asarray(ref, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if b.size == 0:
        return 0.0
    if np.isnan(a).any() or np.isnan(b).any():
        return 0.0 if np.array_equal(np.isnan(a), np.isnan(b)) and np.allclose(
            np.nan_to_num(a), np.nan_to_num(b)) else float("inf")
    scale = float(np.max(np.abs(b)))
    diff = float(np.max(np.abs(a - b)))
    return diff / scale if scale > 0 else diff


def errors(outs: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> dict[str, float]:
    missing = sorted(set(refs) - set(outs))
    if missing:
        raise KeyError(f"outputs {missing} missing (kiln gave {sorted(outs)})")
    return {n: rel_err(outs[n], r) for n, r in refs.items()}


def shape_note(outs: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> str:
    bad = [f"{n}: {tuple(np.shape(outs[n]))} vs {tuple(np.shape(r))}"
           for n, r in refs.items() if n in outs and np.shape(outs[n]) != np.shape(r)]
    return ("shapes differ from onnxruntime's: " + "; ".join(bad)) if bad else ""


def median_s(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """The median wall time of ``runs`` calls of ``fn``, in seconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], min_s: float, min_iters: int,
                warmup_s: float, block_s: float = 0.1, max_s: float = 10.0,
                clock: Callable[[], float] = time.perf_counter,
                gap_s: float = 0.005) -> dict[str, dict]:
    """Median latency (ms) of each function, timed in alternating blocks of about ``block_s``,
    so that the machine's slow and fast stretches fall on every peer alike (the machine is
    shared). Each runs at least ``min_iters`` times and ``min_s`` seconds, except that one that
    has taken ``max_s`` seconds stops after 3 runs (a model of seconds per call). ``gap_s``:
    a pause before each block, so that the threads one system leaves spinning after its block
    (onnxruntime's spin before they sleep) do not run into the next system's block."""
    for fn in fns.values():
        t0 = clock()
        while clock() - t0 < warmup_s:
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    spent = dict.fromkeys(fns, 0.0)
    def more(k: str) -> bool:
        if spent[k] >= max_s and len(times[k]) >= 3:
            return False
        return len(times[k]) < min_iters or spent[k] < min_s

    while any(more(k) for k in fns):
        for k, fn in fns.items():
            if not more(k):
                continue
            if gap_s:
                time.sleep(gap_s)
            t_block = clock()
            while True:
                a = clock()
                fn()
                b = clock()
                times[k].append(b - a)
                if b - t_block >= block_s:
                    break
            spent[k] += clock() - t_block
    return {k: {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v),
                "iterations": len(v)} for k, v in times.items()}


def describe_error(stage: str, exc: BaseException) -> str:
    """``stage: Type: message`` on one line (a multi-line message joined with '; ')."""
    lines = [ln.strip(" -") for ln in str(exc).strip().splitlines() if ln.strip()]
    where = ""
    tb = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if tb:  # a bare error (no message) also names the function: where it was raised says what
        func = "" if lines else f" in {tb[-1].name}"
        where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno}{func})"
    return f"{stage}: {type(exc).__name__}: {'; '.join(lines)}"[:560] + where
