"""One corpus model on CUDA: kiln FP32 (TF32 off, untuned) checked against onnxruntime FP32;
kiln FP16 against torch eager FP16 and torch.compile(mode="reduce-overhead") FP16 on the
re-created torch module (the spec's seeded definition, so the same weights as the export), at
batch 1 and a large batch where the model's batch dim is dynamic. Each system is timed per call
(synchronized after every call) and back-to-back (``BACK_TO_BACK`` calls queued, one
synchronize, time / calls), with its peak device memory (torch's allocator, above what was
allocated before it was made).

Per kiln FP16 engine also: the cold build time, the build time again with the cold build's
timing cache, and at batch 1 the issue's cold start: a fresh process that has imported torch
and kiln and initialised CUDA, timed from ``kiln.load`` to the first outputs on the host."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from bench.corpus.manifest import Entry
from bench.corpus.measure import describe_error, errors
from bench.corpus.runner import (
    Options,
    base_row,
    build_kiln,
    check,
    kiln_outputs,
    reference_spread,
    run_reference,
)

BACK_TO_BACK = 20
PROFILE_COLD_START = os.environ.get("KILN_BENCH_COLD_PROFILE") == "1"  # cProfile it too
PROGRESS_ROW = None  # the row being measured, which a build in progress reports through PROGRESS
PROGRESS = None  # set by the worker: called with the row after every system, so that a worker
# stopped at its time limit still reports what it measured
LARGE_BATCH = {"cnn": 64, "detector": 8, "segmentation": 16, "vision-transformer": 64,
               "encoder": 64, "decoder": 16, "seq2seq-encoder": 32, "audio-encoder": 8,
               "ocr": 32, "recurrent": 64, "quantized": 32}


def fresh_memory_window() -> None:
    """Start a system's peak-memory window with nothing of the systems before it held: cached
    blocks released and cuBLAS's per-stream workspaces (32 MiB each) dropped, so that every
    system pays for its own (a peer on the default stream would otherwise reuse the one an
    earlier system's build allocated there, and look 32 MiB lighter)."""
    import torch

    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def timed(fn, sync, min_s: float, min_iters: int) -> dict:
    fn()
    sync()
    lat, t_end = [], time.perf_counter() + min_s
    while len(lat) < min_iters or time.perf_counter() < t_end:
        a = time.perf_counter()
        fn()
        sync()
        lat.append(time.perf_counter() - a)
    a = time.perf_counter()
    for _ in range(BACK_TO_BACK):
        fn()
    sync()
    b2b = (time.perf_counter() - a) / BACK_TO_BACK
    return {"per_call_ms": 1e3 * float(np.median(lat)), "back_to_back_ms": 1e3 * b2b}


def kiln_system(path: Path, feeds: dict, fp16: bool, tmp: Path, info: dict):
    import torch

    import kiln

    tag = f"{path.stem}-{'fp16' if fp16 else 'fp32'}-b{next(iter(feeds.values())).shape[0]}"
    cache = tmp / f"{tag}.cache"

    def config():
        return kiln.BuilderConfig(device="cuda", fp16=fp16, low_precision_io=fp16,
                                  timing_cache=str(cache),
                                  profiles=[kiln.Profile.fixed({k: v.shape
                                                                for k, v in feeds.items()})])
    t0 = time.perf_counter()
    lines: list[str] = []
    seen = [time.monotonic()]

    def log(msg: str) -> None:  # the build's log, and the row reported every 5 s meanwhile
        lines.append(msg)
        if not msg.startswith("autotune "):  # (a line per tuned layer: only the tail's)
            info.setdefault("build_log", []).append(msg[:300])
        if PROGRESS_ROW is not None and time.monotonic() - seen[0] > 5.0:
            seen[0] = time.monotonic()
            info["build_log_tail"] = [ln[:300] for ln in lines[-3:]]
            info["build_lines"] = len(lines)
            PROGRESS(PROGRESS_ROW)
    builder = kiln.Builder(config(), log=log)
    engine = builder.build(str(path))
    info["build_s"] = time.perf_counter() - t0
    info["build_parts"] = {"parse_s": builder.report.get("parse_s"),
                           "autotune": builder.report.get("autotune_summary"),
                           "precompile": builder.report.get("precompile"),
                           "binaries": builder.report.get("binaries")}
    info["build_log"] = info.get("build_log", [])[-30:]
    info.pop("build_log_tail", None)
    if next(iter(feeds.values())).shape[0] == 1:  # at b1 only: a warm build costs device time
        t0 = time.perf_counter()
        kiln.Builder(config()).build(str(path))  # again, with the first build's timing cache
        info["warm_build_s"] = time.perf_counter() - t0
    out = tmp / f"{tag}.kiln"
    engine.save(out)
    del engine
    info["engine"] = str(out)
    fresh_memory_window()
    info["mem_base"] = torch.cuda.memory_allocated()
    ctx = kiln.load(out).create_context()
    dev = {i.name: torch.from_numpy(feeds[i.name].astype(i.dtype.np, copy=False)).cuda()
           for i in ctx.engine.inputs}
    return lambda: ctx.run(dev, copy_outputs=False)


COLD_START = """
import sys, time, json
import numpy as np
import kiln
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
feeds = dict(np.load(sys.argv[2]))
prof = None
if sys.argv[3:] == ["profile"]:  # the same under cProfile: where the time goes
    import cProfile, pstats, io
    prof = cProfile.Profile(); prof.enable()
t0 = time.perf_counter()
engine = kiln.load(sys.argv[1])
t1 = time.perf_counter()
ctx = engine.create_context()
out = ctx.run({i.name: feeds[i.name].astype(i.dtype.np, copy=False) for i in engine.inputs})
host = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in out.items()}
t2 = time.perf_counter()
if prof is not None:
    prof.disable(); s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    print(s.getvalue()[-12000:], file=sys.stderr)
binaries = sys.modules.get("kiln.kernels.triton.binary")
print(json.dumps({"load_ms": 1e3 * (t1 - t0), "load_first_run_ms": 1e3 * (t2 - t0),
                  "binaries_installed": binaries.installed() if binaries else None,
                  "binaries_note": getattr(engine, "binaries_note", None),
                  "triton_imported": "triton" in sys.modules}))
"""


def cold_start(engine_path: str, feeds: dict, tmp: Path) -> dict:
    """Fresh process, after ``import torch, kiln`` and CUDA init: load + first inference."""
    import json
    import subprocess
    import sys

    npz = tmp / "cold-feeds.npz"
    np.savez(npz, **feeds)
    def fresh(*extra):
        return subprocess.run([sys.executable, "-c", COLD_START, engine_path, str(npz), *extra],
                              capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[2])
    proc = fresh()
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""]
        return {"cold_start_error": tail[0][:300]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if PROFILE_COLD_START:
        prof = fresh("profile")  # another fresh process: the clean timing stays clean
        out["cold_profile"] = prof.stderr[-6000:]
    return out


def torch_system(name: str, feeds: dict, entry: Entry, compiled: bool, info: dict):
    import torch

    from bench.corpus import registry

    fresh_memory_window()
    info["mem_base"] = torch.cuda.memory_allocated()
    module = registry.get(name).make().half().cuda()
    args = []
    for i in entry.inputs:
        t = torch.from_numpy(feeds[i.name]).cuda()
        args.append(t.half() if t.is_floating_point() else t)
    fn = torch.compile(module, mode="reduce-overhead") if compiled else module

    def run():
        with torch.inference_mode():
            return fn(*args)
    return run


def fp16_error(out, entry: Entry, refs: dict | None) -> float | None:
    """Max rel err of an FP16 system's batch-1 outputs against the FP32 reference (kiln gives
    a dict by name, a torch module a tensor or a tuple in the export's output order)."""
    if refs is None:
        return None
    if isinstance(out, dict):
        outs = kiln_outputs(out)
    else:
        seq = out if isinstance(out, (tuple, list)) else (out,)
        outs = kiln_outputs(dict(zip(entry.outputs, seq)))
    # an output whose reference lies below FP16's normal range (EfficientNet-B0's seeded
    # logits: 3.5e-14) is zeros in any FP16 system: no FP16 error is measurable there
    tiny = float(np.finfo(np.float16).tiny)
    refs = {k: r for k, r in refs.items() if np.size(r) == 0 or np.max(np.abs(r)) >= tiny}
    if not refs:
        return None
    errs = errors({k: v for k, v in outs.items() if k in refs}, refs)
    return max(errs.values(), default=0.0)


def _systems(entry: Entry, path: Path, feeds: dict, tmp: Path, kiln_only: bool = False) -> dict:
    """The timed systems: kiln FP16 and, where the model has a torch definition, its peers
    (kiln FP32 is the accuracy check only: the issue compares FP16 systems)."""
    out = {"kiln fp16": lambda info: kiln_system(path, feeds, True, tmp, info)}
    if entry.has_torch_definition and not kiln_only:
        out["torch eager fp16"] = lambda info: torch_system(entry.name, feeds, entry, False,
                                                            info)
        out["torch.compile reduce-overhead fp16"] = lambda info: torch_system(
            entry.name, feeds, entry, True, info)
    return out


def check_fp32(entry: Entry, path: Path, feeds: dict, refs: dict | None, tmp: Path,
               row: dict) -> None:
    """The CPU runner's build on CUDA: layer count, build time, near misses, FP32 error. Built
    untuned (``tune=False``: the PyTorch kernels, in seconds): this is the accuracy check of
    the graph on the device; the tuned kernels are checked by the FP16 engine's error against
    the same reference (and by the tuner, which verifies every candidate's outputs)."""
    import kiln

    try:
        engine_file = build_kiln(path, Options("cuda"), tmp, row, tune=False)
        ctx = kiln.load(engine_file).create_context()
        outs = kiln_outputs(ctx.run({i.name: feeds[i.name].astype(i.dtype.np, copy=False)
                                     for i in ctx.engine.inputs}))
    except Exception as exc:
        row.update(status="build failed", error=describe_error("kiln build/run", exc))
        return
    if refs is not None:  # the CPU runner's judgement, onnxruntime's own spread included
        check(row, outs, refs, spread=lambda: reference_spread(path, feeds, refs))


def run_model(entry: Entry, corpus: Path, tmp: Path, opts: Options) -> dict:
    global PROGRESS_ROW
    import torch

    row = base_row(entry)
    path = corpus / entry.file
    feeds = entry.feeds(seed=0)
    try:
        _, _, refs = run_reference(path, feeds, Options("cuda", opts.threads), row)
    except Exception as exc:
        refs = None
        row.update(status="no reference", error=describe_error("onnxruntime", exc))
    check_fp32(entry, path, feeds, refs, tmp, row)
    if PROGRESS is not None:
        PROGRESS(row)
    batches = [1] + ([opts.large_batch or LARGE_BATCH.get(entry.family, 16)]
                     if entry.batch_dynamic and not opts.kiln_only else [])
    row["cuda"] = {}
    for b in batches:
        bf = entry.feeds(seed=0, batch=b)
        for system, make in _systems(entry, path, bf, tmp, opts.kiln_only).items():
            key = f"{system} b{b}"
            info: dict = {}
            row["cuda"][key] = info  # filled in as it goes (a stopped worker reports it)
            PROGRESS_ROW = row
            try:
                fn = make(info)
                err = fp16_error(fn(), entry, refs) if b == 1 else None
                res = timed(fn, torch.cuda.synchronize, opts.min_s, opts.min_iters)
                res["peak_mem_mib"] = (torch.cuda.max_memory_allocated()
                                       - info.pop("mem_base", 0)) / 2**20
                res["max_rel_err"] = err
                res.update(info)
                del fn
                if system == "kiln fp16" and b == 1:
                    res.update(cold_start(info["engine"], bf, tmp))
                row["cuda"][key] = res
            except Exception as exc:
                row["cuda"][key] = {"error": describe_error(system, exc), **info}
            torch.cuda.empty_cache()
            if PROGRESS is not None:
                PROGRESS(row)
    return row
