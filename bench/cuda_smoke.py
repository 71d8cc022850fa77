"""CUDA smoke benchmark: kiln FP16 on the GPU against PyTorch FP16 peers, in one run.

    PYTHONPATH=. python bench/cuda_smoke.py --out OUTDIR [--quick] [--skip-compile]

For ResNet-50 and BERT-base (s128): builds a kiln FP16 CUDA engine, checks it against the FP32
PyTorch module (on the GPU, TF32 off), times kiln with CUDA graphs on and off, PyTorch eager
FP16 and torch.compile(mode="reduce-overhead") FP16 at batch 1 and a big batch (ResNet 256,
BERT 64), compares peak device memory with eager FP16, and times loading a saved engine and its
first inference. Writes OUTDIR/cuda_smoke.json and OUTDIR/cuda_smoke.md after every part, so a
part that fails (recorded with its error) or a run cut short loses nothing else.

It cannot hang: torch.compile gets a deadline per call, parts are skipped once the run's time
budget (7 min) is spent, and a watchdog ends the process at 7.8 min (faulthandler at 7.9 min,
even if the main thread holds the GIL) after writing what it has.

Accuracy: max|out - ref| / max|ref| over the output. kiln FP16 passes when that is at most
``max(FP16_TOL, 1.5 x PyTorch eager FP16's own error)``: the reference models have random
weights, and a 50-layer random ResNet loses about 2% in FP16 whatever runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from bench.peers import deadline

FP16_TOL = 2e-2
BUDGET_S = 420.0  # parts that would start after this are skipped
WATCHDOG_S = 468.0  # write what we have and exit
COMPILE_DEADLINE_S = 75.0  # per torch.compile first call
MODELS = {"resnet50": {"big": 256, "opts": {}}, "bert-base": {"big": 64, "opts": {}}}
QUICK = {"resnet50": {"big": 8, "opts": {}},
         "bert-base": {"big": 8, "opts": {"layers": 2}}}
T0 = time.monotonic()
RESULTS: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "models": {}, "errors": []}
_WRITE_LOCK = threading.Lock()
OUT: Path = Path(".")


# ---- bookkeeping -----------------------------------------------------------------------------

def elapsed() -> float:
    return time.monotonic() - T0


def write() -> None:
    with _WRITE_LOCK:
        RESULTS["elapsed_s"] = round(elapsed(), 1)
        (OUT / "cuda_smoke.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        (OUT / "cuda_smoke.md").write_text(markdown(RESULTS))


def part(model: str, name: str, fn, *, need_s: float = 5.0):
    """Run one part; record its result or its error; never raise."""
    slot = RESULTS["models"].setdefault(model, {})
    if elapsed() + need_s > BUDGET_S:
        slot[name] = {"skipped": f"time budget: {elapsed():.0f} s used of {BUDGET_S:.0f}"}
        write()
        return None
    t = time.perf_counter()
    try:
        out = fn()
        slot[name] = out if isinstance(out, dict) else {"value": out}
        return out
    except Exception as e:
        slot[name] = {"error": f"{type(e).__name__}: {e}"[:800],
                      "traceback": traceback.format_exc()[-3000:]}
        RESULTS["errors"].append(f"{model}/{name}: {type(e).__name__}: {e}"[:300])
        return None
    finally:
        if isinstance(slot.get(name), dict):
            slot[name]["part_s"] = round(time.perf_counter() - t, 2)
        write()


def watchdog() -> None:
    def fire():
        RESULTS["errors"].append(f"watchdog: run stopped after {elapsed():.0f} s")
        with contextlib.suppress(Exception):
            write()
        os._exit(3)
    t = threading.Timer(WATCHDOG_S, fire)
    t.daemon = True
    t.start()
    faulthandler.dump_traceback_later(WATCHDOG_S + 8, exit=True)


def sync() -> None:
    torch.cuda.synchronize()


def time_fn(fn, min_iters: int = 10, max_s: float = 1.5, warmup: int = 3) -> dict:
    """Latency of ``fn`` (one finished inference; synchronised here after each call)."""
    for _ in range(warmup):
        fn()
    sync()
    lat, start = [], time.perf_counter()
    while len(lat) < min_iters or time.perf_counter() - start < max_s:
        t = time.perf_counter()
        fn()
        sync()
        lat.append(time.perf_counter() - t)
        if len(lat) >= 2000 or (time.perf_counter() - start > 3 * max_s and len(lat) >= 3):
            break
    lat.sort()
    return {"median_ms": 1e3 * statistics.median(lat), "min_ms": 1e3 * lat[0],
            "p90_ms": 1e3 * lat[int(0.9 * (len(lat) - 1))], "iters": len(lat)}


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    scale = float(np.max(np.abs(ref))) or 1.0
    err = float(np.max(np.abs(out - ref))) / scale
    return err if np.isfinite(err) else float("inf")


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---- the systems -----------------------------------------------------------------------------

def torch_module(name: str, opts: dict, fp16: bool):
    from kiln.zoo.export import MODELS as ZOO

    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)  # the same weights as the ONNX export
        model, _ = ZOO[name].module.build(**opts)
    model = model.eval().cuda()
    return model.half() if fp16 else model


def torch_args(name: str, feeds: dict, fp16: bool) -> list:
    from kiln.zoo.export import MODELS as ZOO

    args = [torch.from_numpy(feeds[n]).cuda() for n in ZOO[name].module.INPUT_NAMES]
    return [a.half() if fp16 and a.is_floating_point() else a for a in args]


def torch_call(model, args, fp16: bool, step=None):
    def run():
        if step is not None:
            step()
        amp = torch.autocast("cuda", dtype=torch.float16) if fp16 else contextlib.nullcontext()
        with torch.inference_mode(), amp:
            return model(*args)
    return run


def first(y):
    return y[0] if isinstance(y, (tuple, list)) else y


def time_kiln(ctx, feeds: dict, batch: int) -> dict:
    """Device in/out (as the torch peers run), numpy in/out, and the CUDA breakdown."""
    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    r = time_fn(lambda: ctx.run(dev))
    r["numpy_io"] = time_fn(lambda: ctx.run(feeds), max_s=0.8)
    ctx.cuda.record_timing = True
    br = []
    for _ in range(20):
        ctx.run(feeds)
        br.append(ctx.cuda.last_timing)
    r["breakdown_ms"] = {k.replace("_s", "_ms"): statistics.median(
        (1e3 if k == "enqueue_s" else 1) * t[k] for t in br) for k in br[0]}
    r["decision"] = next(iter(ctx.cuda.decisions.values()), "?")
    r["items_per_s"] = batch / (r["median_ms"] / 1e3)
    return r


_COLD = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np, torch, kiln
t1 = time.perf_counter()
torch.zeros(1, device="cuda")
t2 = time.perf_counter()
feeds = dict(np.load(sys.argv[2]))
t3 = time.perf_counter()
engine = kiln.load(sys.argv[1])
t4 = time.perf_counter()
ctx = engine.create_context()
ctx.run(feeds)
t5 = time.perf_counter()
ctx.run(feeds)
t6 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "cuda_init_s": t2 - t1, "load_s": t4 - t3,
                  "first_inference_s": t5 - t4, "second_inference_s": t6 - t5,
                  "decisions": list(ctx.cuda.decisions.values())}))
"""


def cold_load(path: Path, feeds: dict, tmp: Path) -> dict:
    """Load + first inference of a saved engine in a fresh process (nothing warm: no cuDNN
    autotuning cache, no CUDA context)."""
    import subprocess

    npz = tmp / f"{path.stem}-feeds.npz"
    np.savez(npz, **feeds)
    p = subprocess.run([sys.executable, "-c", _COLD, str(path), str(npz)], capture_output=True,
                       text=True, timeout=90)
    if p.returncode != 0:
        raise RuntimeError(f"the fresh process failed ({p.returncode}): {p.stderr[-600:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["file_mib"] = path.stat().st_size / 2**20
    res["note"] = ("fresh process; load includes copying the weights to the GPU; first "
                   "inference = eager warm-up (cuDNN autotuning) + CUDA graph capture + check")
    return res


# ---- one model ---------------------------------------------------------------------------------

def run_model(name: str, cfg: dict, skip_compile: bool, tmp: Path) -> None:
    import kiln
    from kiln.zoo import build_onnx, sample_inputs

    opts, big = cfg["opts"], cfg["big"]
    batches = (1, big)
    onnx = part(name, "export", lambda: {"path": str(build_onnx(name, **opts))}, need_s=60)
    if onnx is None:
        return
    feeds = {b: sample_inputs(name, batch=b, seq=128, **opts) for b in batches}
    check_b = 1 if name == "resnet50" else 4  # BERT: padded rows in the mask too
    feeds.setdefault(check_b, sample_inputs(name, batch=check_b, seq=128, **opts))
    state: dict = {}

    def reference():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = torch_module(name, opts, fp16=False)
        with torch.inference_mode():
            y = first(model(*torch_args(name, feeds[check_b], False)))
        state["ref"] = y.float().cpu().numpy()
        del model
        free()
        return {"batch": check_b, "what": "PyTorch FP32 module on the GPU, TF32 off"}

    part(name, "reference_fp32", reference)

    def build():
        t = time.perf_counter()
        b = kiln.Builder(kiln.BuilderConfig(device="cuda", fp16=True))
        engine = b.build(onnx["path"])
        state["engine"] = engine
        return {"build_s": round(time.perf_counter() - t, 2), "layers": len(engine.graph.nodes),
                "ops": engine.graph.op_counts(), "weight_bytes": engine.weight_bytes}

    if part(name, "kiln_build_fp16", build, need_s=20) is None:
        return
    engine = state["engine"]
    out_name = engine.outputs[0].name

    def accuracy():
        res = {}
        for graphs in (True, False):
            ctx = engine.create_context(cuda_graph=graphs)
            for _ in range(2):  # the second run replays the captured graph
                y = ctx.run(feeds[check_b])[out_name]
            res[f"kiln_graphs_{'on' if graphs else 'off'}"] = rel_err(y, state["ref"])
            res[f"decisions_{'on' if graphs else 'off'}"] = {
                str(k): v for k, v in ctx.cuda.decisions.items()}
        model = torch_module(name, opts, fp16=True)
        y = first(torch_call(model, torch_args(name, feeds[check_b], True), True)())
        res["torch_eager_fp16"] = rel_err(y.float().cpu().numpy(), state["ref"])
        del model
        free()
        tol = max(FP16_TOL, 1.5 * res["torch_eager_fp16"])
        res.update(tolerance=tol, metric="max|out - ref| / max|ref|",
                   passed=all(res[k] <= tol for k in ("kiln_graphs_on", "kiln_graphs_off")))
        return res

    if "ref" in state:
        part(name, "accuracy", accuracy)
    part(name, "kiln_device_memory",
         lambda: engine.device_memory({k: v.shape for k, v in feeds[big].items()}))

    def kiln_timing(graphs: bool):
        def go():
            res = {f"b{b}": time_kiln(engine.create_context(cuda_graph=graphs), feeds[b], b)
                   for b in batches}
            free()
            return res
        return go

    part(name, "kiln_fp16_graphs_on", kiln_timing(True), need_s=10)
    part(name, "kiln_fp16_graphs_off", kiln_timing(False), need_s=10)

    def memory_kiln():
        engine_path = tmp / f"{name}.kiln"
        engine.save(engine_path)
        state["path"] = engine_path
        free()
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        e = kiln.load(engine_path)
        ctx = e.create_context()
        for _ in range(2):
            ctx.run(feeds[big])
        sync()
        peak = torch.cuda.max_memory_allocated() - base
        del ctx, e
        free()
        return {"peak_mib": peak / 2**20, "batch": big,
                "method": "max_memory_allocated over load + 2 runs (capture + replay) minus "
                          "memory_allocated before"}

    part(name, "kiln_peak_memory", memory_kiln, need_s=10)

    def eager():
        res = {}
        free()
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = torch_module(name, opts, fp16=True)
        for b in batches:
            res[f"b{b}"] = time_fn(torch_call(model, torch_args(name, feeds[b], True), True))
            res[f"b{b}"]["items_per_s"] = b / (res[f"b{b}"]["median_ms"] / 1e3)
            if b == big:
                sync()
                res["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del model
        free()
        return res

    part(name, "torch_eager_fp16", eager, need_s=10)

    def compiled():
        res = {}
        for b in batches:
            if elapsed() + COMPILE_DEADLINE_S > BUDGET_S:
                res[f"b{b}"] = {"skipped": "time budget"}
                continue
            torch._dynamo.reset()
            model = torch_module(name, opts, fp16=True)
            fn = torch.compile(model, mode="reduce-overhead", dynamic=False)
            run = torch_call(fn, torch_args(name, feeds[b], True), True,
                             step=torch.compiler.cudagraph_mark_step_begin)
            t = time.perf_counter()
            try:
                with deadline(COMPILE_DEADLINE_S):
                    run()
                    sync()
            except TimeoutError as e:
                res[f"b{b}"] = {"skipped": f"first call (compile) {e}"}
                continue
            r = time_fn(run)
            r["first_call_s"] = round(time.perf_counter() - t, 1)
            r["items_per_s"] = b / (r["median_ms"] / 1e3)
            res[f"b{b}"] = r
            del fn, model, run
            torch._dynamo.reset()
            free()
        return res

    if not skip_compile:
        part(name, "torch_compile_reduce_overhead_fp16", compiled, need_s=30)

    def load_first():
        path = state.get("path")
        if path is None:
            path = tmp / f"{name}.kiln"
            engine.save(path)
        return cold_load(path, feeds[1], tmp)

    part(name, "load_and_first_inference", load_first, need_s=10)
    state.clear()
    free()


# ---- report ------------------------------------------------------------------------------------

def _ms(d: dict | None, b: str) -> str:
    r = (d or {}).get(b)
    if not isinstance(r, dict):
        return "-"
    if "median_ms" not in r:
        return r.get("skipped") or r.get("error", "-")[:40]
    return f"{r['median_ms']:.3f} ms ({r['items_per_s']:.0f}/s)"


def markdown(res: dict) -> str:
    lines = [f"# kiln CUDA smoke ({res.get('device', '?')})", "",
             f"started {res['started']}, {res.get('elapsed_s', 0)} s; versions: "
             f"{res.get('versions', {})}", ""]
    for name, m in res["models"].items():
        big = f"b{(QUICK if res.get('quick') else MODELS)[name]['big']}"
        lines += [f"## {name}", "", f"| system | b1 latency (items/s) | {big} latency (items/s) |",
                  "|---|---|---|"]
        for key, label in (("kiln_fp16_graphs_on", "kiln FP16, CUDA graphs"),
                           ("kiln_fp16_graphs_off", "kiln FP16, eager launches"),
                           ("torch_eager_fp16", "PyTorch eager FP16"),
                           ("torch_compile_reduce_overhead_fp16",
                            "torch.compile reduce-overhead FP16")):
            d = m.get(key)
            if d is None:
                continue
            if "error" in d or "skipped" in d:
                lines.append(f"| {label} | {d.get('error', d.get('skipped'))[:60]} | |")
                continue
            lines.append(f"| {label} | {_ms(d, 'b1')} | {_ms(d, big)} |")
        lines.append("")
        for key in ("kiln_fp16_graphs_on", "kiln_fp16_graphs_off"):
            d = m.get(key) or {}
            for b in ("b1", big):
                r = d.get(b)
                if isinstance(r, dict) and "breakdown_ms" in r:
                    bd = ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown_ms"].items())
                    lines.append(f"- {key} {b}: numpy I/O {r['numpy_io']['median_ms']:.3f} ms; "
                                 f"breakdown (ms) {bd}; {r['decision']}")
        acc = m.get("accuracy", {})
        if "passed" in acc:
            lines.append(f"- accuracy ({acc['metric']}, tolerance {acc['tolerance']:.3g}): "
                         f"kiln graphs on {acc['kiln_graphs_on']:.2e}, off "
                         f"{acc['kiln_graphs_off']:.2e}, eager FP16 "
                         f"{acc['torch_eager_fp16']:.2e} -> "
                         f"{'PASS' if acc['passed'] else 'FAIL'}")
        mem, pk = m.get("kiln_device_memory", {}), m.get("kiln_peak_memory", {})
        eager_pk = m.get("torch_eager_fp16", {}).get("peak_mib")
        if "total" in mem:
            lines.append(f"- kiln device_memory(): weights {mem['weights'] / 2**20:.1f} MiB, "
                         f"activations {mem['activations'] / 2**20:.1f} MiB, workspace "
                         f"{mem['workspace'] / 2**20:.1f} MiB")
        if "peak_mib" in pk:
            lines.append(f"- peak memory at {big}: kiln {pk['peak_mib']:.0f} MiB vs eager FP16 "
                         f"{eager_pk if eager_pk is None else round(eager_pk)} MiB")
        lf = m.get("load_and_first_inference", {})
        if "load_s" in lf:
            lines.append(f"- saved engine ({lf['file_mib']:.0f} MiB), fresh process: import "
                         f"{lf['import_s']:.2f} s, CUDA init {lf['cuda_init_s']:.2f} s, load "
                         f"{lf['load_s']:.3f} s, first inference {lf['first_inference_s']:.3f} "
                         f"s, second {1e3 * lf['second_inference_s']:.2f} ms")
        errs = [f"{k}: {v['error'][:200]}" for k, v in m.items()
                if isinstance(v, dict) and "error" in v]
        lines += [f"- ERROR {e}" for e in errs] + [""]
    if res["errors"]:
        lines += ["## errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    global OUT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for cuda_smoke.json / cuda_smoke.md")
    p.add_argument("--quick", action="store_true", help="small batches, 2-layer BERT")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile peer")
    p.add_argument("--models", default="resnet50,bert-base")
    args = p.parse_args(argv)
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    watchdog()
    RESULTS["quick"] = args.quick
    if not torch.cuda.is_available():
        RESULTS["errors"].append("no CUDA device")
        write()
        return 2
    from kiln.runtime.cuda import fingerprint

    fp = fingerprint("cuda")
    RESULTS["device"] = fp["name"]
    RESULTS["versions"] = {k: fp.get(k) for k in ("capability", "cuda_version",
                                                  "torch_version", "triton_version")}
    table = QUICK if args.quick else MODELS
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                run_model(name, table[name], args.skip_compile, Path(tmp))
            except Exception as e:  # belt and braces: parts catch their own
                RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}"[:300])
            write()
    print((OUT / "cuda_smoke.md").read_text())
    faulthandler.cancel_dump_traceback_later()
    return 0 if not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
