"""Where a CUDA build's time goes: each corpus model built FP16 at batch 1 (fixed profile, as
``bench.corpus`` builds it) three times, each in a fresh process:

1. ``cold``: an empty Triton cache and no timing cache (a user's first build), under cProfile,
   once per ``--compile-workers`` value;
2. ``warm-triton``: the same Triton cache on disk (compiled kernels are loaded, not compiled),
   no timing cache: what the tactic timing itself costs;
3. ``warm``: both caches (TensorRT's rebuild with a timing cache).

Per build: seconds, the builder's autotune and parallel-compile summaries, and for the cold
ones the cProfile functions with the most cumulative and own time (Triton's compile shows as
``make_cubin`` / ptxas subprocess waits and LLVM's ``optimize_module``).

    python -m bench.build_profile --models timm_tf_mobilenetv3_op13,hf_bert_sdpa_op17 \
        --compile-workers 0,auto --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.corpus import manifest


def worker(model: str, corpus: Path, cache: str, profile: bool, workers: int | None) -> dict:
    import cProfile
    import io
    import pstats

    import kiln

    entry = manifest.load(corpus)[model]
    feeds = entry.feeds(seed=0)
    cfg = kiln.BuilderConfig(device="cuda", fp16=True, low_precision_io=True,
                             timing_cache=cache or None, compile_workers=workers,
                             profiles=[kiln.Profile.fixed({k: v.shape for k, v in feeds.items()})])
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    builder = kiln.Builder(cfg)
    builder.build(str(corpus / entry.file))
    if prof:
        prof.disable()
    out = {"model": model, "build_s": round(time.perf_counter() - t0, 3),
           "autotune": builder.report.get("autotune_summary"),
           "precompile": builder.report.get("precompile")}
    if prof:
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
            out[f"profile_{key}"] = s.getvalue()[-9000:]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="comma-separated corpus model names")
    p.add_argument("--corpus", default=str(manifest.DEFAULT_DIR))
    p.add_argument("--out", default=".", help="folder for build_profile.json and .txt")
    p.add_argument("--compile-workers", default="0",
                   help="comma-separated BuilderConfig.compile_workers values: one cold build "
                        "each, each with an empty Triton cache ('auto': the default); the "
                        "warm builds use the last")
    p.add_argument("--no-profile", action="store_true", help="no cProfile in the cold builds")
    p.add_argument("--worker", nargs=4, metavar=("MODEL", "CACHE", "PROFILE", "WORKERS"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    corpus = Path(a.corpus)
    if a.worker:
        model, cache, prof, w = a.worker
        print(json.dumps(worker(model, corpus, "" if cache == "-" else cache, prof == "1",
                                None if w == "auto" else int(w))))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    counts = a.compile_workers.split(",")
    for model in a.models.split(","):
        runs = [("cold", w) for w in counts] + [("warm-triton", counts[-1]), ("warm", counts[-1])]
        with tempfile.TemporaryDirectory(prefix="kiln-bp-") as tmp:
            for k, (phase, w) in enumerate(runs):
                fresh = phase == "cold"  # an empty Triton cache per cold build
                triton_dir = Path(tmp) / (f"triton{k}" if fresh else f"triton{len(counts) - 1}")
                env = dict(os.environ, TRITON_CACHE_DIR=str(triton_dir))
                timing = str(Path(tmp) / f"timing{k}.cache")
                if phase == "warm":  # the last cold build's timing cache
                    timing = str(Path(tmp) / f"timing{len(counts) - 1}.cache")
                cmd = [sys.executable, "-m", "bench.build_profile", "--corpus", str(corpus),
                       "--models", model, "--worker", model,
                       "-" if phase == "warm-triton" else timing,
                       "1" if fresh and not a.no_profile else "0", w]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                row = {"model": model, "phase": phase, "compile_workers": w,
                       "process_s": round(time.perf_counter() - t0, 2)}
                try:
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    row["error"] = (proc.stderr.strip().splitlines() or [""])[-1][:300]
                rows.append(row)
                print(json.dumps({k2: v for k2, v in row.items()
                                  if not k2.startswith("profile")}), flush=True)
    (out / "build_profile.json").write_text(json.dumps(rows, indent=1))
    with open(out / "build_profile.txt", "w") as f:
        for r in rows:
            for key in ("profile_cumulative", "profile_tottime"):
                if key in r:
                    f.write(f"==== {r['model']} {r['phase']} {key}\n{r[key]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
