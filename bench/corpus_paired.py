"""``python -m bench.corpus_paired MODEL [--threads N] [--rounds R] [--qdq-shared-int8]``: kiln
and onnxruntime on one corpus model in one process, in alternating blocks of ``--per-round``
runs each (a pause between), for a machine shared with other work: ``bench.corpus`` times each
system in its own stretch, and at 2 threads on a loaded 2-core VM onnxruntime's pool loses
most (7-12 ms against 2.4 quiet on hf_distilbert_qstatic_qdq). Prints both medians, the ratio
of the medians and the median (and range) of the per-round ratios, and the last run's max
errors against onnxruntime (a planned run: the first one runs step by step). The engine is
built as ``bench.corpus`` builds it (a fixed profile at the fed shapes)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.corpus_paired", description=__doc__)
    ap.add_argument("model", help="a corpus model name (manifest.json)")
    ap.add_argument("--corpus", default=str(Path.home() / ".cache/kiln/corpus"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.05, metavar="S")
    ap.add_argument("--qdq-shared-int8", action="store_true",
                    help="build with BuilderConfig.qdq_shared_int8")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import kiln  # before torch: kiln sets OpenMP's wait policy

    import numpy as np  # isort: skip
    import torch  # isort: skip

    from bench.corpus.manifest import load as load_manifest
    from bench.corpus.runner import kiln_feeds, ort_session

    torch.set_num_threads(args.threads)
    corpus = Path(args.corpus)
    entry = load_manifest(corpus)[args.model]
    path = corpus / entry.file
    feeds = entry.feeds(seed=0)
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    cfg = kiln.BuilderConfig(tf32=False, profiles=[kiln.Profile.fixed(shapes)],
                             qdq_shared_int8=args.qdq_shared_int8)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "m.kiln"
        kiln.Builder(cfg).build(str(path)).save(f)
        ctx = kiln.load(f).create_context()
    kf = kiln_feeds(ctx.engine, feeds)
    sess = ort_session(path, "cpu", args.threads)
    of = {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    for _ in range(5):
        ctx.run(kf)
        sess.run(None, of)
    kt, ot, ratios = [], [], []
    for _ in range(args.rounds):
        ks, os_ = [], []
        for fn, out in ((lambda: ctx.run(kf), ks), (lambda: sess.run(None, of), os_)):
            for _ in range(args.per_round):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            time.sleep(args.pause)
        kt += ks
        ot += os_
        ratios.append(statistics.median(ks) / statistics.median(os_))
    k, o = statistics.median(kt), statistics.median(ot)
    print(f"{args.model} threads={args.threads}{' qdq_shared_int8' * args.qdq_shared_int8}: "
          f"kiln {1e3 * k:.3f} ms, onnxruntime {1e3 * o:.3f} ms, ratio of medians {k / o:.2f}, "
          f"per-round ratio median {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}], load {os.getloadavg()[0]:.2f}")
    got = ctx.run(kf)
    for name, want in zip([x.name for x in sess.get_outputs()], sess.run(None, of)):
        g = np.asarray(got[name], dtype=np.float64)
        err = np.abs(g - want).max()
        print(f"  {name}: max abs err {err:.3g}, rel {err / max(np.abs(want).max(), 1e-30):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
