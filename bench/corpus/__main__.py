"""python -m bench.corpus: kiln against onnxruntime on every corpus model.

    python -m bench.corpus --device cpu
    python -m bench.corpus --device cpu --models hf_bert_sdpa_op17,ppocr_det_v4 --json /tmp/c.json
    python -m bench.corpus --device cuda     # + kiln FP16 vs torch eager / torch.compile FP16

Each model runs in its own worker process (kiln and onnxruntime side by side in it, 2 threads
each), so that a model that crashes or hangs becomes a row saying so, and the run goes on.
Writes bench/results/corpus-<device>-<date>.{json,md} (or --json OUT and OUT's .md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.corpus import manifest, table
from bench.corpus.manifest import Entry
from bench.corpus.measure import describe_error
from bench.corpus.runner import Options, base_row

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.corpus", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--corpus", default=str(manifest.DEFAULT_DIR),
                   help=f"corpus directory (default {manifest.DEFAULT_DIR})")
    p.add_argument("--models", default=None, help="comma-separated model names (default all)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="results file (default bench/results/corpus-<device>-<date>.json); "
                        "the Markdown table goes next to it (.md)")
    p.add_argument("--threads", type=int, default=2, help="threads for kiln and onnxruntime")
    p.add_argument("--duration", type=float, default=1.0, metavar="S",
                   help="at least this many timed seconds per system (1.0)")
    p.add_argument("--iterations", type=int, default=10, help="at least this many runs (10)")
    p.add_argument("--warmup", type=float, default=0.3, metavar="S", help="warm-up seconds")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="a model's worker is stopped after this long and reported (600)")
    p.add_argument("--omp-wait-policy", choices=("default", "passive", "active"),
                   default="default",
                   help="OMP_WAIT_POLICY for the workers (default: as the environment has it); "
                        "on a machine shared with other work, OpenMP's spinning threads make "
                        "kiln many times slower, and 'passive' measures it closer to an idle "
                        "machine")
    p.add_argument("--kiln-only", action="store_true",
                   help="CUDA: kiln alone at batch 1 (FP32 check, FP16 build, error, timing, "
                        "cold start), no torch peers and no large batch: a quick pass over "
                        "many models for 'builds, runs and matches FP32'")
    p.add_argument("--large-batch", type=int, default=0, metavar="N",
                   help="CUDA: the large batch for every batch-dynamic model (default: per "
                        "family, e.g. 64 for CNNs and encoders)")
    p.add_argument("--note", default="", help="a line for the report (the machine was shared)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # MODEL:OUT, internal
    return p.parse_args(argv)


def options(args) -> Options:
    return Options(args.device, args.threads, args.warmup, args.duration, args.iterations,
                   args.kiln_only, args.large_batch)


def work(args) -> int:
    """Worker: one model, its row as JSON to the given file."""
    name, out = args.worker.split(":", 1)
    entry = manifest.load(args.corpus)[name]
    if args.device == "cuda":
        from bench.corpus import cuda
        from bench.corpus.cuda import run_model

        cuda.PROGRESS = lambda row: Path(out).write_text(json.dumps(dict(row, partial=True)))
    else:
        from bench.corpus.runner import run_model
    with tempfile.TemporaryDirectory(prefix="kiln-corpus-") as tmp:
        row = run_model(entry, Path(args.corpus), Path(tmp), options(args))
    Path(out).write_text(json.dumps(row))
    return 0


def run_worker(entry: Entry, args, tmp: Path) -> dict:
    out = tmp / f"{entry.name}.json"
    cmd = [sys.executable, "-m", "bench.corpus", "--worker", f"{entry.name}:{out}",
           "--device", args.device, "--corpus", args.corpus, "--threads", str(args.threads),
           "--duration", str(args.duration), "--iterations", str(args.iterations),
           "--warmup", str(args.warmup)] + (["--kiln-only"] if args.kiln_only else [])
    cmd += ["--large-batch", str(args.large_batch)] if args.large_batch else []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                              cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        stopped = f"worker stopped after {args.timeout:.0f} s"
        if out.exists():  # a CUDA worker's rows so far
            row = json.loads(out.read_text())
            return dict(row, status="timed out", error=f"{stopped}; the systems it reached "
                        "are reported")
        return dict(base_row(entry), status="timed out", error=stopped)
    if proc.returncode == 0 and out.exists():
        row = json.loads(out.read_text())
        row.pop("partial", None)
        return row
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
    how = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    return dict(base_row(entry), status="crashed", error=f"worker {how}: {tail[0][:300]}")


def run(args, path: Path | None = None) -> dict:
    entries = manifest.load(args.corpus)
    # smallest files first: on a slow day the most rows land before a stop
    names = (args.models.split(",") if args.models
             else sorted(entries, key=lambda n: (entries[n].bytes, n)))
    unknown = [n for n in names if n not in entries]
    if unknown:
        raise SystemExit(f"--models: {unknown} not in {args.corpus}; it has {sorted(entries)}")
    result = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "device": args.device, "command": command(sys.argv[1:]),
              "machine": machine(), "corpus": str(args.corpus), "notes": args.note,
              "threads": args.threads, "rows": [],
              "omp_wait_policy": (args.omp_wait_policy if args.omp_wait_policy != "default"
                                  else os.environ.get("OMP_WAIT_POLICY", "unset"))}
    with tempfile.TemporaryDirectory(prefix="kiln-corpus-") as tmp:
        for name in names:
            sys.stderr.write(f"{name} ...\n")
            try:
                row = run_worker(entries[name], args, Path(tmp))
            except Exception as exc:  # the runner's own trouble: still a row
                row = dict(base_row(entries[name]), status="crashed",
                           error=describe_error("runner", exc))
            result["rows"].append(row)
            if row.get("omp_wait_policy"):  # what the worker's kiln ran with
                result["omp_wait_policy"] = row["omp_wait_policy"]
            if path is not None:  # a run that is stopped still leaves its rows
                write(dict(result, complete=False), path)
            sys.stderr.write(f"  {row['status']} {row.get('ratio') or ''} {row['error']}\n")
    return result


def command(argv: list[str]) -> str:
    """The command line as run, the --note text left out (it is printed under the table)."""
    kept, skip = [], False
    for a in argv:
        if skip or a.startswith("--note="):
            skip = False
            continue
        if a == "--note":
            skip = True
            continue
        kept.append(a)
    return " ".join(["python -m bench.corpus", *kept])


def machine() -> str:
    cores = os.cpu_count()
    try:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "?"
    return f"{cores} cores, load average {load} at start"


def write(result: dict, path: Path) -> tuple[Path, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    md = path.with_suffix(".md")
    md.write_text(table.markdown(result))
    return path, md


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return work(args)
    today = dt.date.today().isoformat()
    path = Path(args.json) if args.json else RESULTS / f"corpus-{args.device}-{today}.json"
    result = run(args, path)
    js, md = write(dict(result, complete=True), path)
    print(table.markdown(result), end="")
    sys.stderr.write(f"wrote {js} and {md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
