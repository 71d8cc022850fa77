"""python -m bench.run: kiln against its peers, side by side, in one process, on identical inputs.

    python -m bench.run --device cpu --markdown
    python -m bench.run --device cuda --markdown
    python -m bench.run --device cpu --quick --no-compile --json /tmp/b.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import memory, report
from bench.peers import TOLERANCE, Peer, Skipped, Unavailable, max_rel_err, peers
from bench.workloads import DEFAULT_MODELS, Workload, workloads
from kiln.perf.timing import TimingConfig, measure, summarize
from kiln.runtime import host

RESULTS = Path(__file__).resolve().parent / "results"
FULL = TimingConfig(warmup_s=1.0, min_iterations=10, min_duration_s=3.0, percentiles=(90.0,))
QUICK = TimingConfig(warmup_s=0.05, min_iterations=3, min_duration_s=0.1, percentiles=(90.0,))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--models", default=None,
                   help=f"comma-separated zoo models (default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--batches", default=None,
                   help="comma-separated batch sizes for every model (default: 1 and the "
                        "device's large batch)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model variants, batch 1, seq 16, short timing (for tests)")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--systems", default=None,
                   help="comma-separated systems to run (default: all of the device's; the "
                        "FP32 reference candidates onnxruntime and torch eager always run)")
    p.add_argument("--compile-timeout", type=float, default=300.0, metavar="S",
                   help="report torch.compile as skipped when its first call takes longer (300)")
    p.add_argument("--warmup", type=float, default=None, metavar="S", help="warm-up seconds")
    p.add_argument("--iterations", type=int, default=None, help="at least this many runs")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="and at least this many seconds")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="JSON file (default bench/results/<device>-<date>.json); the Markdown "
                        "table is written next to it (.md)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--readme", action="store_true",
                   help="afterwards regenerate README.md's benchmark tables from bench/results "
                        "(python -m bench.readme)")
    return p.parse_args(argv)


def _split(s: str | None, conv=str):
    return [conv(x) for x in s.split(",") if x.strip()] if s else None


def timing_config(args) -> TimingConfig:
    base = QUICK if args.quick else FULL
    return TimingConfig(
        warmup_s=base.warmup_s if args.warmup is None else args.warmup,
        min_iterations=base.min_iterations if args.iterations is None else args.iterations,
        min_duration_s=base.min_duration_s if args.duration is None else args.duration,
        percentiles=base.percentiles)


def machine_info(device: str) -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": gpu, "loadavg_start": _loadavg(), "platform": platform.platform()}


def _loadavg() -> str | None:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def versions() -> dict:
    import kiln

    out = {"kiln": kiln.__version__, "python": platform.python_version()}
    for pkg in ("torch", "onnxruntime", "onnx", "numpy", "triton"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _reason(exc: BaseException) -> str:
    seen = exc
    while seen is not None:  # torch.compile wraps what it caught
        if isinstance(seen, (Skipped, Unavailable)):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:160]


def _status(exc: BaseException) -> str:
    seen = exc
    while seen is not None:
        if isinstance(seen, Skipped):
            return "skipped"
        if isinstance(seen, Unavailable):
            return "n/a"
        seen = seen.__cause__ or seen.__context__
    return "failed"


def run_one(peer: Peer, wl: Workload, device: str, tmp: Path, cfg: TimingConfig,
            ref: list | None) -> tuple[dict, list | None]:
    """Build (kiln), set up, check against ``ref`` and time one system; returns its row and its
    outputs. ``peak_mem_mib`` covers set-up (loading) and the runs; a build step is measured
    on its own, as ``build_peak_mem_mib``, before the inference measurement starts."""
    row = {"key": wl.key, "workload": wl.name, "model": wl.model, "batch": wl.batch,
           "seq": wl.seq, "options": wl.options, "system": peer.name,
           "precision": peer.precision, "kiln": peer.is_kiln, "tolerance": peer.tolerance,
           "status": "ok", "reason": "", "reference": False, "peak_mem_mib": None}
    outs = prep = None
    try:
        build_s = _build(peer, wl, device, tmp, row)
        with memory.PeakMemory(device) as mem:
            t0 = time.perf_counter()
            prep = peer.prepare(wl, device, tmp)
            row["setup_s"] = build_s + time.perf_counter() - t0
            row["compile_s"] = prep.first_call_s
            row["note"] = prep.note or row.get("note", "")
            outs = prep.fetch(prep.run())
            _check(row, peer, outs, ref)
            records, wall = measure([prep.run], cfg)
        prep = None  # the system goes before memory.release(), so none of it counts for the next
        s = summarize(records, wall, wl.batch, cfg.percentiles)
        row.update(median_ms=s.latency_ms["median"], p90_ms=s.percentiles_ms["p90"],
                   items_per_s=s.items_per_s, timing=s.to_json(), peak_mem_mib=mem.peak_mib)
    except Exception as exc:  # a failing peer is a table row, not a crash
        row.update(status=_status(exc), reason=_reason(exc), peak_mem_mib=None)
        outs = prep = None
    memory.release()
    return row, outs


def _build(peer: Peer, wl: Workload, device: str, tmp: Path, row: dict) -> float:
    """Run the peer's offline build step, if it has one, under its own memory measurement
    (``build_s``, ``build_peak_mem_mib``, the build's note); returns its seconds."""
    if peer.build is None:
        return 0.0
    with memory.PeakMemory(device) as mem:
        t0 = time.perf_counter()
        row["note"] = peer.build(wl, device, tmp)
        row["build_s"] = time.perf_counter() - t0
    row["build_peak_mem_mib"] = mem.peak_mib
    return row["build_s"]


def _check(row: dict, peer: Peer, outs: list, ref: list | None) -> None:
    if ref is None and peer.precision != "fp32":
        row["max_rel_err"] = None  # nothing to check against: every FP32 row failed
    elif ref is None:
        row["reference"] = True
        row["max_rel_err"] = 0.0
    else:
        row["max_rel_err"] = max_rel_err(outs, ref)
        if not row["max_rel_err"] <= peer.tolerance:
            row["status"] = "mismatch"  # reported, and still timed


def run_suite(args, path: Path | None = None) -> dict:
    """Run every workload on every system; with ``path``, the results so far are written there
    after each workload (``"complete": false`` until the end), so a long run that is stopped
    still leaves its numbers."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(os.cpu_count() or 1)  # as onnxruntime's intra_op_num_threads
    # every system runs in this one process: kiln's CPU contexts set glibc's malloc to keep
    # freed memory, process-wide, so set it before any runs and every torch system has it
    # too, whatever the order (onnxruntime has its own arena)
    keeps = device == "cpu" and host.keep_freed_memory()
    cfg = timing_config(args)
    wls = workloads(device, _split(args.models), _split(args.batches, int), args.quick)
    line_up = peers(device, compile=not args.no_compile, compile_timeout=args.compile_timeout)
    if args.systems:
        wanted = set(_split(args.systems)) | {"onnxruntime", "torch eager"}
        unknown = wanted - {p.name for p in line_up}
        if unknown:
            raise SystemExit(f"--systems: unknown {sorted(unknown)}; this device runs "
                             f"{[p.name for p in line_up]}")
        line_up = [p for p in line_up if p.name in wanted]
    result = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device, "machine": machine_info(device), "versions": versions(),
        "command": " ".join(["python -m bench.run", *sys.argv[1:]]),
        "timing": {"warmup_s": cfg.warmup_s, "min_iterations": cfg.min_iterations,
                   "min_duration_s": cfg.min_duration_s},
        "reference": "onnxruntime FP32 (torch eager FP32 where onnxruntime fails)",
        "tolerance": {"definition": "max|out - ref| / max|ref| over each output",
                      **TOLERANCE},
        "memory_method": memory.CUDA_METHOD if device == "cuda" else memory.CPU_METHOD,
        "host_malloc": ("glibc keeps freed memory (kiln.runtime.host), for every system"
                        if keeps else "as the process found it"),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        for wl in wls:
            wl.onnx_path()  # export outside any system's timing and memory
            ref = None
            for peer in line_up:
                _log(f"{wl.name} b{wl.batch}: {peer.name} ...")
                row, outs = run_one(peer, wl, device, Path(tmp), cfg, ref)
                if ref is None and outs is not None and peer.precision == "fp32":
                    ref = outs
                result["rows"].append(row)
                if path is not None:
                    report.write(dict(result, complete=False), path)
                done = (f"median {row['median_ms']:.2f} ms" if "median_ms" in row
                        else row["reason"])
                _log(f"  {row['status']}: {done}")
    result["machine"]["loadavg_end"] = _loadavg()
    result["complete"] = True
    report.add_speedups(result["rows"])
    return result


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    today = dt.date.today().isoformat()
    path = Path(args.json) if args.json else RESULTS / f"{args.device}-{today}.json"
    result = run_suite(args, path)
    print(report.table(result, markdown=args.markdown), end="")
    js, mdp = report.write(result, path)
    _log(f"wrote {js} and {mdp}")
    if args.readme:
        from bench import readme

        _log("README.md " + ("updated" if readme.update() else "already current"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
