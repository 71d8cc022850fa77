"""python -m bench.paired: kiln against one peer in alternating rounds, for a noisy machine.

    python -m bench.paired --models bert-base,minilm,gpt2 --batches 1,8 --markdown

``bench.run`` times each system for a few seconds in turn; on a shared VM the machine's speed
drifts by 10-20% over tens of seconds, and a system timed in a slow phase loses by that much.
Here each system lives in its own worker process (so no thread pool of one spins next to the
other's), both are set up once, and then they take turns: ``--per-round`` runs of kiln, a pause
of ``--pause`` seconds (so the pool that just ran goes idle), the same number of runs of the peer,
for ``--rounds`` rounds. Both see the same phases of the machine. Reported per workload: each
system's median over all its runs, the ratio of the medians (kiln / peer; < 1: kiln is faster)
and the median and range of the per-round ratios. Outputs are checked against the peer's before
timing (the bench's FP32 tolerance). Every worker sets glibc's malloc as kiln's CPU contexts do
(``kiln.runtime.host``), so large outputs reuse pages for the peer too, as in ``bench.run``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

PEERS = ("onnxruntime", "torch eager", "torch.compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.paired",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert-base,minilm,gpt2",
                   help="comma-separated zoo models (default bert-base,minilm,gpt2)")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (1,8)")
    p.add_argument("--peer", default="onnxruntime", choices=PEERS)
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds (8)")
    p.add_argument("--per-round", type=int, default=5, help="runs per system per round (5)")
    p.add_argument("--pause", type=float, default=0.05, metavar="S",
                   help="seconds between one system's runs and the other's (0.05)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return p.parse_args(argv)


def _worker(system: str, model: str, batch: int, tmp: str, conn) -> None:
    """Set up ``system`` on the workload, send its outputs, then time ``n`` runs per request
    (0 ends)."""
    import os

    import torch

    from bench.peers import peers
    from bench.workloads import workloads
    from kiln.runtime import host

    try:
        torch.set_num_threads(os.cpu_count() or 1)  # as onnxruntime's intra_op_num_threads
        # glibc keeps freed memory in every worker, as in bench.run (where all systems share
        # one process): a peer's large outputs then reuse pages as kiln's do
        host.keep_freed_memory()
        wl = workloads("cpu", [model], [batch])[0]
        peer = {p.name: p for p in peers("cpu")}[system]
        if peer.build is not None:
            peer.build(wl, "cpu", Path(tmp))
        prep = peer.prepare(wl, "cpu", Path(tmp))
        outs = prep.fetch(prep.run())
        conn.send(("ready", wl.name, outs))
    except Exception as e:  # reported by the parent, which stops the pair
        conn.send(("error", f"{type(e).__name__}: {e}", None))
        return
    while (n := conn.recv()) > 0:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            prep.run()
            ts.append(time.perf_counter() - t0)
        conn.send(ts)


def pair(model: str, batch: int, peer: str, rounds: int, per_round: int, pause: float) -> dict:
    from bench.peers import TOLERANCE, max_rel_err

    ctx = mp.get_context("spawn")
    workers, row = {}, {"model": model, "batch": batch, "peer": peer}
    with tempfile.TemporaryDirectory(prefix="kiln-paired-") as tmp:
        try:
            outs = {}
            for system in ("kiln", peer):
                a, b = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(system, model, batch, tmp, b))
                proc.start()
                status, info, outs[system] = a.recv()
                if status != "ready":
                    raise RuntimeError(f"{system} on {model} b{batch}: {info}")
                row["workload"] = info
                workers[system] = (proc, a)
            row["max_rel_err"] = max_rel_err(outs["kiln"], outs[peer])
            row["check"] = "ok" if row["max_rel_err"] <= TOLERANCE["fp32"] else "mismatch"
            times = {s: [] for s in workers}
            ratios = []
            for _ in range(rounds):
                med = {}
                for system, (_, conn) in workers.items():
                    time.sleep(pause)
                    conn.send(per_round)
                    ts = conn.recv()
                    times[system] += ts
                    med[system] = statistics.median(ts)
                ratios.append(med["kiln"] / med[peer])
        finally:
            for proc, conn in workers.values():
                conn.send(0)
                proc.join(timeout=30)
    row["kiln_ms"] = 1e3 * statistics.median(times["kiln"])
    row["peer_ms"] = 1e3 * statistics.median(times[peer])
    row["ratio"] = row["kiln_ms"] / row["peer_ms"]
    row["round_ratio_median"] = statistics.median(ratios)
    row["round_ratio_range"] = (min(ratios), max(ratios))
    return row


def markdown(rows: list[dict], peer: str) -> str:
    lines = [f"| workload | batch | kiln ms | {peer} ms | kiln / {peer} | per-round ratio, "
             "median [range] | check |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lo, hi = r["round_ratio_range"]
        lines.append(f"| {r['workload']} | {r['batch']} | {r['kiln_ms']:.2f} | "
                     f"{r['peer_ms']:.2f} | {r['ratio']:.3f} | {r['round_ratio_median']:.3f} "
                     f"[{lo:.2f}..{hi:.2f}] | {r['check']} ({r['max_rel_err']:.1e}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"{model} b{batch} ...", file=sys.stderr, flush=True)
            r = pair(model.strip(), batch, args.peer, args.rounds, args.per_round, args.pause)
            print(f"  kiln {r['kiln_ms']:.2f} ms, {args.peer} {r['peer_ms']:.2f} ms, "
                  f"ratio {r['ratio']:.3f}", file=sys.stderr, flush=True)
            rows.append(r)
    if args.markdown:
        print(markdown(rows, args.peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
