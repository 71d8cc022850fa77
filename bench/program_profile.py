"""``python -m bench.program_profile MODEL [--runs N] [--top K]``: where a corpus model's time
goes in kiln's native CPU program, per record (what ``kiln run --dump-profile`` cannot show: it
times the Python step loop, not the program). Native records are timed in C
(``kiln_chain_run_timed``), torch records around their kernel call; the table sums, per node
and per op, each record's median over ``--runs`` runs (after warm-up runs), with onnxruntime's
time for the same feeds as the yardstick. The timed run is a little slower than a plain one
(two clock reads per record)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def programs(engine):
    """The native programs of the engine's executors (subgraphs' too), where planned."""
    seen, out, todo = set(), [], list(engine._executors)
    while todo:
        ex = todo.pop()
        if id(ex) in seen:
            continue
        seen.add(id(ex))
        if ex.program is not None:
            out.append(ex.program)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.program_profile", description=__doc__)
    ap.add_argument("model", help="a corpus model name (manifest.json)")
    ap.add_argument("--corpus", default=str(Path.home() / ".cache/kiln/corpus"))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import kiln  # before torch: kiln sets OpenMP's wait policy

    import torch  # isort: skip

    from bench.corpus.manifest import load as load_manifest
    from bench.corpus.runner import Options, build_kiln, kiln_feeds, ort_session

    torch.set_num_threads(args.threads)
    entry = load_manifest(Path(args.corpus))[args.model]
    path = Path(args.corpus) / entry.file
    feeds = entry.feeds(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        f = build_kiln(path, Options(threads=args.threads), Path(tmp), {},
                       shapes={k: tuple(v.shape) for k, v in feeds.items()})
        ctx = kiln.load(f).create_context()
    kf = kiln_feeds(ctx.engine, feeds)
    sess = ort_session(path, "cpu", args.threads)
    ins = {i.name for i in sess.get_inputs()}
    of = {k: v for k, v in feeds.items() if k in ins}
    for _ in range(3):
        ctx.run(kf)
        sess.run(None, of)
    progs = programs(ctx.engine)
    loop = not progs or not any(p.plans and any(p.plans.values()) for p in progs)
    if loop:
        print(f"{args.model}: no native program ran (the Python step loop runs it: its steps "
              f"timed one by one)")
    for p in progs:
        p.profile = {}
    wall, ort = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        ctx.run(kf)
        wall.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sess.run(None, of)
        ort.append(time.perf_counter() - t0)
    rows: dict = {}
    if loop:
        from kiln.kernels.torch.convert import to_torch
        from kiln.perf.layers import profile_layers

        layers = profile_layers(ctx.engine, [to_torch(kf[i.name]) for i in ctx.engine.inputs],
                                runs=args.runs)
        rows = {(r["name"], r["op"], r["tactic"] or "step"): r["median_ms"] / 1e3
                for r in layers}
    for p in progs:
        for key, secs in (p.profile or {}).items():
            rows[key] = rows.get(key, 0.0) + statistics.median(secs)
        p.profile = None
    n = args.runs
    wall.sort()
    ort.sort()
    total = sum(rows.values())
    print(f"{args.model}: kiln (profiled) median {1e3 * wall[n // 2]:.2f} ms, records "
          f"{1e3 * total:.2f} ms; onnxruntime median {1e3 * ort[n // 2]:.2f} ms")
    by_op: dict = {}
    for (_, op, kind), sec in rows.items():
        k = (op, kind)
        by_op[k] = [by_op.get(k, [0.0, 0])[0] + sec, by_op.get(k, [0.0, 0])[1] + 1]
    print("\nper op and record kind: ms (medians summed), records, share")
    for (op, kind), (sec, cnt) in sorted(by_op.items(), key=lambda kv: -kv[1][0]):
        print(f"  {op:28s} {kind:10s} {1e3 * sec:8.3f} {cnt:5d} {sec / total:6.1%}")
    print(f"\ntop {args.top} records: median ms")
    for (name, op, kind), sec in sorted(rows.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {1e3 * sec:8.3f}  {op:24s} {kind:10s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
