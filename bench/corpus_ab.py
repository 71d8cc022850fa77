"""Two checkouts' kiln on corpus models, in alternating processes, beside onnxruntime.

    python -m bench.corpus_ab --base /path/to/other/checkout [--new .] --models a,b
        [--rounds 5] [--secs 2] [--threads 2]

Each round runs one worker process per checkout (the order alternates round to round), with
``PYTHONPATH`` and the working directory set to that checkout, so each imports its own kiln
and its own built C library. A worker builds every model at its bench feeds
(:func:`bench.corpus.runner.build_kiln`, a fixed profile), then times kiln and onnxruntime in
alternating blocks of ~0.15 s for at least ``--secs`` seconds and 5 blocks each (OpenMP's
passive wait policy, ``--threads`` threads each), and prints the medians. The table gives per
model each checkout's median over rounds, its kiln/onnxruntime ratio (median over rounds, both
timed in the same process), and base -> new as the ratio of the medians and as the median of
the per-round ratios (a round's two processes ran minutes apart at most, so the paired ratio
is the steadier one on a shared machine). Both checkouts need their extension built
(``python setup.py build_ext --inplace``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(models: list[str], corpus: Path, threads: int, secs: float) -> dict:
    import kiln  # before torch: kiln sets OpenMP's wait policy

    import torch  # isort: skip

    from bench.corpus.manifest import load as load_manifest
    from bench.corpus.runner import Options, build_kiln, kiln_feeds, ort_session

    torch.set_num_threads(threads)
    manifest = load_manifest(corpus)
    out = {}
    for name in models:
        entry = manifest[name]
        feeds = entry.feeds(seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            f = build_kiln(corpus / entry.file, Options(threads=threads), Path(tmp), {},
                           shapes={k: tuple(v.shape) for k, v in feeds.items()})
            ctx = kiln.load(f).create_context()
        kf = kiln_feeds(ctx.engine, feeds)
        sess = ort_session(corpus / entry.file, "cpu", threads)
        of = {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
        for _ in range(3):
            ctx.run(kf)
            sess.run(None, of)
        t0 = time.perf_counter()
        ctx.run(kf)
        n = max(5, min(2000, int(0.15 / max(time.perf_counter() - t0, 1e-6))))
        ks: list[float] = []
        os_: list[float] = []
        end = time.perf_counter() + secs
        while time.perf_counter() < end or len(ks) < 5 * n:
            for _ in range(n):
                t0 = time.perf_counter()
                ctx.run(kf)
                ks.append(time.perf_counter() - t0)
            for _ in range(n):
                t0 = time.perf_counter()
                sess.run(None, of)
                os_.append(time.perf_counter() - t0)
        out[name] = (1e3 * statistics.median(ks), 1e3 * statistics.median(os_))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.corpus_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the other checkout (its root)")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--models", required=True, help="corpus model names, comma-separated")
    ap.add_argument("--corpus", default=str(Path.home() / ".cache/kiln/corpus"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--secs", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.worker:
        print(json.dumps(worker(models, Path(args.corpus), args.threads, args.secs)))
        return 0
    if not args.base:
        ap.error("--base is required")
    trees = [("base", args.base), ("new", args.new)]
    got: dict = {t: {m: [] for m in models} for t, _ in trees}
    for r in range(args.rounds):
        for tag, root in (trees if r % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=root, OMP_WAIT_POLICY="PASSIVE")
            p = subprocess.run([sys.executable, "-m", "bench.corpus_ab", "--worker", "--models",
                                args.models, "--corpus", args.corpus, "--threads",
                                str(args.threads), "--secs", str(args.secs)],
                               cwd=root, env=env, capture_output=True, text=True)
            if p.returncode:
                print(f"{tag} worker failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
            for m, v in json.loads(p.stdout.strip().splitlines()[-1]).items():
                got[tag][m].append(v)
    print("| model | base ms | base kiln/ort | new ms | new kiln/ort | new/base (medians) | "
          "new/base (per round) |\n|---|---|---|---|---|---|---|")
    for m in models:
        b, n = got["base"][m], got["new"][m]
        bk, nk = statistics.median(x[0] for x in b), statistics.median(x[0] for x in n)
        br = statistics.median(x[0] / x[1] for x in b)
        nr = statistics.median(x[0] / x[1] for x in n)
        paired = statistics.median(y[0] / x[0] for x, y in zip(b, n))
        print(f"| {m} | {bk:.3f} | {br:.2f} | {nk:.3f} | {nr:.2f} | {nk / bk:.3f} | "
              f"{paired:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
