"""One corpus model on CUDA: kiln FP32 checked against onnxruntime FP32; kiln FP16 against
torch eager FP16 and torch.compile(mode="reduce-overhead") FP16 on the re-created torch module
(the spec's seeded definition, so the same weights as the export), at batch 1 and a large batch
where the model's batch dim is dynamic. Each system is timed per call (synchronized after every
call) and back-to-back (``BACK_TO_BACK`` calls queued, one synchronize, time / calls)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.corpus.manifest import Entry
from bench.corpus.measure import TOLERANCE, describe_error, errors
from bench.corpus.runner import Options, base_row, build_kiln, kiln_outputs, run_reference

BACK_TO_BACK = 20
LARGE_BATCH = {"cnn": 64, "detector": 8, "segmentation": 16, "vision-transformer": 64,
               "encoder": 32, "decoder": 16, "seq2seq-encoder": 32, "audio-encoder": 8,
               "ocr": 32, "recurrent": 64, "quantized": 32}


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


def kiln_system(path: Path, feeds: dict, fp16: bool, tmp: Path):
    import torch

    import kiln

    cfg = kiln.BuilderConfig(device="cuda", fp16=fp16, low_precision_io=fp16,
                             profiles=[kiln.Profile.fixed({k: v.shape
                                                           for k, v in feeds.items()})])
    engine = kiln.Builder(cfg).build(str(path))
    out = tmp / f"{path.stem}-{'fp16' if fp16 else 'fp32'}.kiln"
    engine.save(out)
    ctx = kiln.load(out).create_context()
    dev = {i.name: torch.from_numpy(feeds[i.name].astype(i.dtype.np, copy=False)).cuda()
           for i in ctx.engine.inputs}
    return lambda: ctx.run(dev, copy_outputs=False)


def torch_system(name: str, feeds: dict, entry: Entry, compiled: bool):
    import torch

    from bench.corpus import registry

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
    errs = errors({k: v for k, v in outs.items() if k in refs}, refs)
    return max(errs.values(), default=0.0)


def _systems(entry: Entry, path: Path, feeds: dict, tmp: Path) -> dict:
    out = {"kiln fp32": lambda: kiln_system(path, feeds, False, tmp),
           "kiln fp16": lambda: kiln_system(path, feeds, True, tmp)}
    if entry.has_torch_definition:
        out["torch eager fp16"] = lambda: torch_system(entry.name, feeds, entry, False)
        out["torch.compile reduce-overhead fp16"] = lambda: torch_system(
            entry.name, feeds, entry, True)
    return out


def check_fp32(entry: Entry, path: Path, feeds: dict, refs: dict | None, tmp: Path,
               row: dict) -> None:
    """The CPU runner's build on CUDA: layer count, build time, near misses, FP32 error."""
    import kiln

    try:
        engine_file = build_kiln(path, Options("cuda"), tmp, row)
        ctx = kiln.load(engine_file).create_context()
        outs = kiln_outputs(ctx.run({i.name: feeds[i.name].astype(i.dtype.np, copy=False)
                                     for i in ctx.engine.inputs}))
    except Exception as exc:
        row.update(status="build failed", error=describe_error("kiln build/run", exc))
        return
    if refs is not None:
        row["errors"] = errors(outs, refs)
        row["max_rel_err"] = max(row["errors"].values(), default=0.0)
        row["correct"] = row["max_rel_err"] <= TOLERANCE["fp32"]
        if not row["correct"]:
            row["status"] = "mismatch"


def run_model(entry: Entry, corpus: Path, tmp: Path, opts: Options) -> dict:
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
    batches = [1] + ([LARGE_BATCH.get(entry.family, 16)] if entry.batch_dynamic else [])
    row["cuda"] = {}
    for b in batches:
        bf = entry.feeds(seed=0, batch=b)
        for system, make in _systems(entry, path, bf, tmp).items():
            key = f"{system} b{b}"
            try:
                fn = make()
                err = fp16_error(fn(), entry, refs) if b == 1 and "fp16" in system else None
                row["cuda"][key] = timed(fn, torch.cuda.synchronize, opts.min_s,
                                         opts.min_iters)
                row["cuda"][key]["max_rel_err"] = err
            except Exception as exc:
                row["cuda"][key] = {"error": describe_error(system, exc)}
            torch.cuda.empty_cache()
    return row
