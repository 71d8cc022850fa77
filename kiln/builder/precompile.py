"""Compile a CUDA build's Triton candidates in parallel, before the tuner times them.

Timing a candidate is milliseconds (:class:`kiln.builder.autotune.GraphTimer`); compiling it
is ~0.1 s of Triton and ptxas, and a CNN has hundreds of candidates: compiling them one by
one was most of a cold build (a mobile CNN's 300 candidates: 20-45 s on the H200's host).
Before :func:`kiln.builder.autotune.tune_graph` runs, :func:`precompile` writes the graph as an
untuned engine (its PyTorch kernels) to a temporary file, and ``workers`` processes each load
it and run the tuner's own run, calling each of their candidates once and timing nothing. The
compiled kernels land in Triton's on-disk cache, which the build's own tuning run then hits:
the same graph, shapes and calls specialize the same way, so the keys match (a miss only costs
the compile the build would have done).

The candidates are split by what they compile, not by layer: a worker takes the candidates
whose kernel, tactic and node attributes hash to its index (:func:`owner`), so the layers that
share a compiled kernel (a CNN's repeated blocks: a mobile CNN's 58 layers make 144 distinct
kernels) send it to one worker. Split by layer, every worker compiled most of the shared
kernels again, and 8 workers took 39 s where one process took 20 s. On the H200's host a
kernel's compile is 0.3-0.7 s (LLVM, then ptxas in a subprocess) and was 94% of a cold
mobile-CNN build (``python -m bench.build_profile``: 125 s cold, 8 s with Triton's cache warm).

A worker that fails or runs past its time costs nothing but its share's speed-up: the build
compiles what it finds missing, as before. Each worker holds a CUDA context and a copy of the
weights on the device (TensorRT's builder likewise times tactics with its own device memory).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

WORKER_TIMEOUT_S = 900
MIN_LAYERS = 16  # fewer tuned layers compile in less time than the workers take to start


def default_workers() -> int:
    """Three quarters of the host's cores, at most 12; none on a host of fewer than 4 cores
    (each worker starts Python, torch and a CUDA context: seconds a small machine would not
    win back)."""
    n = os.cpu_count() or 1
    return min(12, n * 3 // 4) if n >= 4 else 0


def affordable(workers: int, weight_bytes: int) -> int:
    """``workers``, fewer where their copies of the weights (one per worker, on the device)
    would take more than a quarter of the free device memory."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    per = weight_bytes + (256 << 20)  # the weights and a CUDA context's own allocations
    return max(0, min(workers, int(free * 0.25 // per)))


def precompile(graph, choices: dict[str, str], profiles: list, workers: int,
               log: Callable[[str], None] = lambda m: None) -> dict:
    """Run ``workers`` compile-only tuning processes over ``graph`` (``choices``: a PyTorch
    kernel per node, so that the temporary engine runs untuned). Returns a summary for the
    build report: workers, seconds, and the failures of workers that failed."""
    import torch

    from kiln.engine.engine import Engine

    t0 = time.perf_counter()
    summary: dict = {"workers": workers, "failed": []}
    with tempfile.TemporaryDirectory(prefix="kiln-precompile-") as tmp:
        path = Path(tmp) / "untuned.kiln"
        Engine(graph, choices, device="cuda", profiles=profiles).save(path)
        torch.cuda.empty_cache()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # kiln's own checkout or site-packages
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        dev = str(torch.cuda.current_device())
        procs = [subprocess.Popen([sys.executable, "-m", "kiln.builder.precompile", str(path),
                                   str(k), str(workers), dev],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env) for k in range(workers)]
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        for k, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out = f"stopped after {WORKER_TIMEOUT_S} s\n" + (out or "")
                p.returncode = p.returncode or -9
            tail = [ln for ln in (out or "").splitlines() if ln.strip()][-1:] or [""]
            if p.returncode != 0:
                summary["failed"].append(f"worker {k}: exit {p.returncode}: {tail[0][:200]}")
            elif tail[0].startswith("precompile worker:"):
                summary.setdefault("worker_lines", []).append(tail[0])
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    log(f"autotune: candidates compiled by {workers} processes in {summary['seconds']:.2f} s"
        + (f"; {len(summary['failed'])} failed ({summary['failed'][0]}): the build compiles "
           "their share itself" if summary["failed"] else ""))
    return summary


def _compile_only(fn) -> float:
    """The workers' timer: one call (the compile), no timing."""
    import torch

    fn()
    torch.cuda.synchronize()
    return 0.0


def owner(kernel_name: str, tactic: dict | None, attrs, n: int) -> int:
    """Which of ``n`` workers compiles this candidate: a stable hash of what its compile
    depends on (kernel, tactic, the node's attributes: an op's attrs object, whose repr lists
    its values), so that equal compiles meet in one worker."""
    attrs = re.sub(r" at 0x[0-9a-f]+", "", repr(attrs))  # no object address: the same in
    key = f"{kernel_name}|{sorted((tactic or {}).items(), key=str)}|{attrs}"  # every worker
    return zlib.crc32(key.encode()) % n


def keeps(k: int, n: int) -> Callable:
    """Worker ``k`` of ``n``'s filter for :func:`kiln.builder.autotune.tune_graph`: its
    compiled (non-PyTorch) candidates."""
    def keep(node_name: str, cand, attrs) -> bool:
        return (cand.kernel.backend != "cpu"
                and owner(cand.kernel.name, cand.tactic, attrs, n) == k)
    return keep


def tuned_layers(graph) -> list[str]:
    """The layers that have CUDA candidates, in the graph's order (subgraphs included)."""
    from kiln.builder.autotune import _nodes
    from kiln.kernels.registry import kernels_for

    return [nd.name for nd in _nodes(graph) if kernels_for(nd.op, "cuda")]


def _worker(path: str, k: int, n: int, device: int) -> int:
    import torch

    import kiln
    import kiln.kernels.triton  # registers the CUDA kernels, which share() counts
    from kiln.builder.autotune import tune_graph

    t0 = time.perf_counter()
    torch.cuda.set_device(device)
    engine = kiln.load(path)
    t1 = time.perf_counter()
    keep = keeps(k, n)
    layers, count = set(), 0
    for profile in engine.profiles or [None]:
        picks = tune_graph(engine.graph, profile, None, timer=_compile_only, keep=keep,
                           log=lambda m: m.startswith("autotune:") and print(m, flush=True))
        layers |= set(picks)
        count += sum(s.timed for s in picks.values())
    print(f"precompile worker: {len(layers)} layers, {count} candidates; started + loaded in "
          f"{t1 - t0:.2f} s, ran in {time.perf_counter() - t1:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
