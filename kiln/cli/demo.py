"""kiln demo: the main job end to end on a model kiln makes itself.

Exports ResNet-50 (random weights, fixed seed) to ONNX, builds and saves an engine, loads it,
checks its outputs against onnxruntime, and times both side by side."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from kiln.cli.args import add_common_args
from kiln.cli.progress import Stages, human_bytes

NAME = "demo"
HELP = "export ResNet-50, build an engine, run it and benchmark it against onnxruntime"


def add_arguments(p):
    p.add_argument("--model", default="resnet50", choices=["resnet50", "bert-base", "gpt2",
                                                           "minilm"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iterations", type=int, default=20, help="timed runs per runtime")
    p.add_argument("--output", help="where to write the engine (default: a temp folder)")
    add_common_args(p)


def main(args) -> int:
    import onnxruntime as ort

    import kiln
    from kiln import zoo

    stages = Stages(5)
    with stages.stage(f"exporting {args.model} to ONNX (cached after the first time)"):
        onnx_path = zoo.build_onnx(args.model)
    with stages.stage("building the kiln engine"):
        engine = kiln.Builder(kiln.BuilderConfig()).build(onnx_path)
        out = args.output or os.path.join(tempfile.mkdtemp(prefix="kiln-demo-"),
                                          f"{args.model}.kiln")
        size = engine.save(out)
    with stages.stage("loading the engine and running it once"):
        t0 = time.perf_counter()
        engine = kiln.load(out)
        ctx = engine.create_context()
        t_load = time.perf_counter() - t0
        feeds = zoo.sample_inputs(args.model, batch=args.batch)
        got = ctx.run(feeds)
        t_first = time.perf_counter() - t0
    with stages.stage("creating an onnxruntime session and comparing outputs"):
        t0 = time.perf_counter()
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        t_ort = time.perf_counter() - t0
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        err = max(_rel_err(got[k], want[k]) for k in want)
    with stages.stage(f"timing {args.iterations} runs of each"):
        k_ms = _time(lambda: ctx.run(feeds), args.iterations)
        o_ms = _time(lambda: sess.run(None, feeds), args.iterations)
    print(f"\nengine {out} ({human_bytes(size)}): load {1e3 * t_load:.1f} ms, load + first "
          f"run {1e3 * t_first:.1f} ms; onnxruntime session creation {1e3 * t_ort:.1f} ms")
    print(f"max relative error vs onnxruntime: {err:.2e}")
    print(f"{'runtime':<14}{'median ms':>10}{'p90 ms':>10}")
    print(f"{'kiln':<14}{k_ms[0]:>10.2f}{k_ms[1]:>10.2f}")
    print(f"{'onnxruntime':<14}{o_ms[0]:>10.2f}{o_ms[1]:>10.2f}")
    print(f"kiln / onnxruntime median latency: {k_ms[0] / o_ms[0]:.2f}x "
          f"({args.model}, batch {args.batch}, CPU, {os.cpu_count()} cores)")
    return 0


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _time(fn, n: int) -> tuple[float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(max(n, 1)):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    ts.sort()
    return statistics.median(ts), ts[min(len(ts) - 1, int(0.9 * len(ts)))]
