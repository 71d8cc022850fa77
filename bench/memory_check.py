"""Device memory of kiln FP16 engines next to PyTorch eager FP16, at the bench's large batches.

    PYTHONPATH=. python bench/memory_check.py --out OUTDIR [--models resnet50,bert-base,gpt2]

Per model (ResNet-50 b256, BERT-base b64 s128, GPT-2 small b8 s128), in one process:

- kiln fp16: the engine is built (FP16, CUDA, a fixed profile at the workload's shapes, as
  bench/peers.py builds it) and saved, and the builder freed; then, with fresh peak statistics,
  the engine is loaded, a context created and run twice (the first run is eager and captures the
  CUDA graph, the second replays it). ``engine.device_memory()`` is read afterwards (it runs the
  engine again and resets the peak statistics).
- kiln fp16, CUDA graphs off: the same engine file, a context with ``cuda_graph=False``, so the
  graph's own cost (its pool, static outputs, the clone of device outputs) shows as a difference.
- torch eager fp16: the zoo module, weights made FP16 on the host, moved to the device, run
  twice under ``torch.inference_mode`` + autocast (bench's eager FP16 peer).

Every figure is MiB of ``torch.cuda.memory_allocated()`` relative to just before loading: the
inputs are made on the device before that and reported apart (``inputs``); ``after run N`` holds
that run's outputs (``outputs``: their size), which are freed before the next run. ``peak`` is
``max_memory_allocated()`` over load + runs (``peak run 1``, ``peak run 2``: per run, the
statistics reset between them); ``reserved`` is the growth of ``memory_reserved()``, which also
holds the caching allocator's free blocks and CUDA-graph pools. A failure is recorded (error and
traceback) and the next system or model goes on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

from bench.peers import _torch_args, _torch_run, engine_path, kiln_config, max_rel_err, torch_module
from bench.workloads import SEQ, Workload

BATCH = {"resnet50": 256, "bert-base": 64, "gpt2": 8}
SYSTEMS = ("kiln fp16", "kiln fp16 no graph", "torch eager fp16")


def _mib(nbytes) -> float | None:
    return None if nbytes is None else round(nbytes / 2**20, 1)


def _free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _out_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class Window:
    """Allocated memory relative to the moment the window opens, and the peaks since."""

    def __init__(self):
        _free()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        self.reserved = torch.cuda.memory_reserved()
        self.marks: dict[str, float | None] = {}
        self.peaks: list[int] = []

    def mark(self, name: str) -> None:
        torch.cuda.synchronize()
        self.marks[name] = _mib(torch.cuda.memory_allocated() - self.base)

    def peak(self, name: str) -> None:
        """Record the peak since the last one as ``name`` and start a new one."""
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated() - self.base)
        self.marks[name] = _mib(self.peaks[-1])
        torch.cuda.reset_peak_memory_stats()

    def close(self) -> dict:
        torch.cuda.synchronize()
        return dict(self.marks, peak=_mib(max(self.peaks)),
                    reserved=_mib(torch.cuda.memory_reserved() - self.reserved),
                    max_reserved=_mib(torch.cuda.max_memory_reserved() - self.reserved))


def build_kiln(wl: Workload, tmp: Path) -> dict:
    """Build and save the FP16 engine; the builder is gone when this returns."""
    import kiln

    w = Window()
    builder = kiln.Builder(kiln_config(wl, "cuda", fp16=True))
    builder.build(str(wl.onnx_path())).save(engine_path(wl, tmp, fp16=True))
    nodes = builder.report.get("nodes_after", {})
    del builder
    w.peak("build peak")
    _free()
    w.mark("left after build")  # what the build leaves allocated: should be ~0
    return {"layers": sum(nodes.values()), **w.marks}


def run_kiln(wl: Workload, tmp: Path, cuda_graph: bool) -> tuple[dict, list]:
    import kiln

    feeds = {k: torch.from_numpy(v).cuda() for k, v in wl.feeds.items()}
    row: dict = {"inputs": _mib(_out_bytes(feeds.values()))}
    w = Window()
    engine = kiln.load(engine_path(wl, tmp, fp16=True))
    w.mark("after load")
    outs = _run_context(engine, feeds, cuda_graph, w, row)
    _free()  # the context is gone: device_memory() measures with one of its own
    dm = engine.device_memory()
    row["device_memory"] = {k: _mib(v) if isinstance(v, int) else v for k, v in dm.items()
                            if k != "method"}
    return row, outs


def _run_context(engine, feeds: dict, cuda_graph: bool, w: Window, row: dict) -> list:
    from kiln.runtime.memory import _cache_bytes

    ctx = engine.create_context(cuda_graph=cuda_graph)
    w.mark("after context")
    outs = _two_runs(w, lambda: list(ctx.run(feeds).values()), row)
    row.update(w.close())  # while the context (its graph pool) still exists
    ex = engine._executor
    row["weights"] = _mib(ex.device_weight_bytes)
    row["kernel caches"] = _mib(_cache_bytes(ex))
    row["decisions"] = {str(k): v for k, v in ctx.cuda.decisions.items()}
    return outs


def run_eager(wl: Workload) -> tuple[dict, list]:
    model = torch_module(wl, "cpu", fp16=True)  # FP16 on the host: the device gets FP16 only
    args = _torch_args(wl, "cuda", fp16=True)
    row: dict = {"inputs": _mib(_out_bytes(args))}
    w = Window()
    model = model.to("cuda")
    w.mark("after load")
    run = _torch_run(model, args, "cuda", fp16=True)
    outs = _two_runs(w, lambda: _as_list(run()), row)
    row.update(w.close())
    row["weights"] = _mib(sum(_out_bytes(t) for t in (model.parameters(), model.buffers())))
    return row, outs


def _as_list(y) -> list:
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _two_runs(w: Window, run, row: dict) -> list[np.ndarray]:
    """Run twice; mark after each with its outputs held, then free them. Returns the second
    run's outputs as numpy."""
    w.peak("peak load")
    for k in (1, 2):
        ys = run()
        w.mark(f"after run {k}")
        row["outputs"] = _mib(_out_bytes(ys))
        if k == 2:
            host = [y.detach().float().cpu().numpy() for y in ys]
        del ys
        w.peak(f"peak run {k}")
    return host


def check_model(model: str, tmp: Path) -> list[dict]:
    wl = Workload(model, BATCH[model], SEQ)
    wl.onnx_path()  # the export, outside every window
    base = {"model": model, "workload": wl.name, "batch": wl.batch, "seq": wl.seq}
    rows, outs = [], {}
    try:
        build = build_kiln(wl, tmp)
    except Exception as e:
        build = {"error": _error(e), "traceback": traceback.format_exc()}
    _free()
    for system in SYSTEMS:
        row = dict(base, system=system)
        try:
            if system == "torch eager fp16":
                r, outs[system] = run_eager(wl)
            elif "error" in build:
                raise RuntimeError(f"no engine: the build failed ({build['error']})")
            else:
                r, outs[system] = run_kiln(wl, tmp, cuda_graph=system == "kiln fp16")
                r["build"] = build
            row.update(r)
        except Exception as e:  # one failure is a row, not the end of the check
            row.update(error=_error(e), traceback=traceback.format_exc())
        _free()
        rows.append(row)
    ref = outs.get("torch eager fp16")
    for row in rows:
        got = outs.get(row["system"])
        if ref is not None and got is not None and row["system"] != "torch eager fp16":
            row["max_rel_err_vs_eager"] = max_rel_err(got, ref)
    engine_path(wl, tmp, fp16=True).unlink(missing_ok=True)
    return rows


def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


COLUMNS = (("model", "workload"), ("system", "system"), ("inputs", "inputs"),
           ("load", "after load"), ("run 1", "after run 1"), ("run 2", "after run 2"),
           ("outputs", "outputs"), ("peak run 1", "peak run 1"), ("peak run 2", "peak run 2"),
           ("peak", "peak"), ("reserved", "reserved"), ("weights", "weights"))


def table(rows: list[dict]) -> str:
    head = [c for c, _ in COLUMNS] + ["device_memory w/a/ws/total", "build peak", "note"]
    lines = []
    for r in rows:
        cells = [_cell(r.get(k)) for _, k in COLUMNS]
        dm = r.get("device_memory") or {}
        cells.append("/".join(_cell(dm.get(k)) for k in ("weights", "activations", "workspace",
                                                         "total")) if dm else "-")
        cells.append(_cell((r.get("build") or {}).get("build peak")))
        decisions = set((r.get("decisions") or {}).values())
        cells.append(r.get("error") or ", ".join(sorted(decisions)))
        lines.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(x.ljust(n) for x, n in zip(head, widths))]
    out += ["  ".join(x.ljust(n) for x, n in zip(cells, widths)) for cells in lines]
    return "\n".join(out) + "\n"


def _cell(x) -> str:
    return "-" if x is None else (f"{x:.0f}" if isinstance(x, float) else str(x))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/memory_check.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for memory_check.json")
    p.add_argument("--models", default=",".join(BATCH),
                   help=f"comma-separated, of {', '.join(BATCH)}")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("memory_check needs a CUDA GPU")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in BATCH]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {', '.join(BATCH)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "unit": "MiB", "method": __doc__, "rows": []}
    with tempfile.TemporaryDirectory(prefix="kiln-memcheck-") as tmp:
        for model in models:
            print(f"{model} ...", file=sys.stderr, flush=True)
            result["rows"] += check_model(model, Path(tmp))
            (out / "memory_check.json").write_text(json.dumps(result, indent=1, default=str))
    print(table(result["rows"]), end="")
    print(f"wrote {out / 'memory_check.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
