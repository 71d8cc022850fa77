"""kiln bench: trtexec-style latency and throughput of an engine."""

from __future__ import annotations

import json
import sys
import time

from kiln.cli.args import add_common_args, parse_shapes
from kiln.errors import KilnError

NAME = "bench"
HELP = "measure an engine's latency and throughput (trtexec-style)"


def add_arguments(p):
    p.add_argument("engine", help="engine file (.kiln) or ONNX model (built in memory)")
    p.add_argument("--shapes", help="input shapes for dynamic dims, e.g. input:8x3x224x224")
    p.add_argument("--warmup", type=float, default=200, metavar="MS", help="warm-up (200 ms)")
    p.add_argument("--iterations", type=int, default=10, help="at least this many runs (10)")
    p.add_argument("--duration", type=float, default=3.0, metavar="S",
                   help="and at least this many seconds (3)")
    p.add_argument("--percentiles", default="90,95,99", help="latency percentiles to report")
    p.add_argument("--streams", type=int, default=1,
                   help="execution contexts running concurrently on the engine")
    p.add_argument("--export-times", metavar="FILE", help="every iteration's timestamps (JSON)")
    p.add_argument("--dump-profile", action="store_true", help="per-layer timing table")
    p.add_argument("--export-profile", metavar="FILE", help="per-layer timing as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="latency distribution + slowest layers")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p)


def main(args) -> int:
    from kiln.cli.run import open_engine
    from kiln.engine.inputs import random_inputs
    from kiln.perf.timing import TimingConfig, measure, summarize

    if args.streams < 1 or args.iterations < 1 or args.duration < 0 or args.warmup < 0:
        raise KilnError("--streams and --iterations must be >= 1, --duration/--warmup >= 0")
    pcts = tuple(float(x) for x in args.percentiles.split(",") if x.strip())
    if args.plot:
        _need_matplotlib()
    engine = open_engine(args.engine)
    profile = engine.profiles[0] if engine.profiles else None
    feeds = random_inputs(engine.inputs, parse_shapes(args.shapes), profile, args.seed)
    ctxs = [engine.create_context() for _ in range(args.streams)]
    gpu_times: list[list[dict]] = [[] for _ in ctxs]
    for c in ctxs:
        if c.cuda is not None:
            c.cuda.record_timing = True

    def call(k, c):
        c.run(feeds)
        if c.cuda is not None:
            gpu_times[k].append(c.cuda.last_timing)

    fns = [lambda k=k, c=c: call(k, c) for k, c in enumerate(ctxs)]
    cfg = TimingConfig(args.warmup / 1e3, args.iterations, args.duration, args.streams, pcts)
    bar = None if args.json else _Bar()
    records, wall = measure(fns, cfg, progress=bar)
    if bar:
        bar.done()
    gpu = gpu_breakdown(records, gpu_times) if ctxs[0].cuda is not None else None
    first = next(iter(feeds.values()), None)
    batch = int(first.shape[0]) if first is not None and first.ndim else 1
    summary = summarize(records, wall, batch, pcts)
    layers = None
    if args.dump_profile or args.export_profile or args.plot:
        from kiln.kernels.torch.convert import to_torch
        from kiln.perf.layers import profile_layers

        args_t = [to_torch(feeds[i.name]) for i in engine.inputs]
        if engine.torch_device is not None:  # the layers' own time, inputs already on the GPU
            args_t = [a.to(engine.torch_device) for a in args_t]
        layers = profile_layers(engine, args_t)
    _export(args, records, layers)
    if args.plot:
        _plot(args.plot, records, layers)
    if args.json:
        out = {"engine": args.engine, "device": engine.device, "streams": args.streams,
               "inputs": {k: list(v.shape) for k, v in feeds.items()}, **summary.to_json()}
        if gpu is not None:
            out["gpu"] = gpu
            out["cuda_graph"] = _decisions(ctxs)
        if layers is not None:
            out["layers"] = layers
        print(json.dumps(out, indent=1))
    else:
        print_summary(summary, engine.device, args.streams, feeds, gpu=gpu,
                      graphs=_decisions(ctxs) if gpu is not None else None)
        if args.dump_profile:
            print_layers(layers)
    return 0


def gpu_breakdown(records, gpu_times: list[list[dict]]) -> dict:
    """Match each timed query with its context's CUDA timings (the last ones each stream
    recorded: the warm-up's come first), set ``Record.enqueue`` and return H2D / GPU compute /
    D2H statistics in ms, as trtexec reports them."""
    cols: dict[str, list[float]] = {"h2d_ms": [], "compute_ms": [], "d2h_ms": []}
    for k, times in enumerate(gpu_times):
        mine = [r for r in records if r.stream == k]
        for r, t in zip(mine, times[len(times) - len(mine):]):
            if t is None:
                continue
            r.enqueue = t["enqueue_s"]
            for key in cols:
                cols[key].append(t[key])
    return {key: _stats(v) for key, v in cols.items() if v}


def _stats(v: list[float]) -> dict:
    v = sorted(v)
    return {"min": v[0], "max": v[-1], "mean": sum(v) / len(v), "median": v[len(v) // 2]}


def _decisions(ctxs) -> dict:
    return {" x ".join("x".join(map(str, shape)) for shape, _ in sig): why
            for c in ctxs[:1] for sig, why in c.cuda.decisions.items()}


def print_summary(s, device: str, streams: int, feeds: dict, out=sys.stdout,
                  gpu: dict | None = None, graphs: dict | None = None) -> None:
    w = out.write
    shapes = ", ".join(f"{k}: {'x'.join(map(str, v.shape))}" for k, v in feeds.items())
    w(f"=== Performance summary ({device}, {streams} stream(s); {shapes}) ===\n")
    w(f"Throughput: {s.qps:.2f} qps, {s.items_per_s:.2f} items/s "
      f"({s.items_per_query} items per query)\n")
    lat = s.latency_ms
    pct = ", ".join(f"percentile({k[1:]}%) = {v:.3f} ms" for k, v in s.percentiles_ms.items())
    w(f"Latency: min = {lat['min']:.3f} ms, max = {lat['max']:.3f} ms, mean = "
      f"{lat['mean']:.3f} ms, median = {lat['median']:.3f} ms, {pct}\n")
    if s.enqueue_ms is None:
        w("Enqueue Time, H2D Latency, GPU Compute Time, D2H Latency: not applicable "
          "(CPU engine: the latency above is all compute)\n")
    else:
        e = s.enqueue_ms
        w(f"Enqueue Time: min = {e['min']:.3f} ms, max = {e['max']:.3f} ms, mean = "
          f"{e['mean']:.3f} ms, median = {e['median']:.3f} ms\n")
    for key, label in (("h2d_ms", "H2D Latency"), ("compute_ms", "GPU Compute Time"),
                       ("d2h_ms", "D2H Latency")):
        if gpu and key in gpu:
            g = gpu[key]
            w(f"{label}: min = {g['min']:.3f} ms, max = {g['max']:.3f} ms, mean = "
              f"{g['mean']:.3f} ms, median = {g['median']:.3f} ms\n")
    for shapes, why in (graphs or {}).items():
        w(f"Execution ({shapes}): {why}\n")
    w(f"Total Host Walltime: {s.wall_s:.3f} s for {s.queries} queries\n")
    w(f"Coefficient of variation: {100 * s.cv:.2f}%\n")
    for msg in s.warnings:
        w(f"[W] {msg}\n")


def print_layers(rows: list[dict], out=sys.stdout, top: int | None = None) -> None:
    w = max([len(r["name"]) for r in rows] + [5])
    out.write(f"\n=== Per-layer profile (separate run) ===\n{'layer':<{w}}  {'op':<20} "
              f"{'total ms':>10} {'avg ms':>9} {'median ms':>10} {'%':>6}  tactic\n")
    for r in rows[:top] if top else rows:
        out.write(f"{r['name']:<{w}}  {r['op']:<20} {r['total_ms']:>10.3f} {r['avg_ms']:>9.4f} "
                  f"{r['median_ms']:>10.4f} {r['percent']:>6.1f}  {r.get('tactic', '')}\n")


def _export(args, records, layers) -> None:
    if args.export_times:
        with open(args.export_times, "w") as f:
            json.dump([{"stream": r.stream, "start_ms": 1e3 * r.start, "end_ms": 1e3 * r.end,
                        "latency_ms": 1e3 * r.latency} for r in records], f, indent=1)
    if args.export_profile:
        with open(args.export_profile, "w") as f:
            json.dump(layers, f, indent=1)


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KilnError("--plot needs matplotlib, which is not installed; install it with "
                        "pip install 'kiln[plot]' (or pip install matplotlib)") from None


def _plot(path: str, records, layers) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.hist([1e3 * r.latency for r in records], bins=40, color="#c0562f")
    a.set_xlabel("latency (ms)")
    a.set_ylabel("queries")
    a.set_title("latency distribution")
    top = (layers or [])[:15][::-1]
    b.barh([f"{r['name'][:30]} ({r['op']})" for r in top], [r["avg_ms"] for r in top],
           color="#2f6fc0")
    b.set_xlabel("average ms per run")
    b.set_title("slowest layers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Bar:
    """A progress bar on stderr for the timed run."""

    def __init__(self):
        self.last = 0.0

    def __call__(self, frac: float) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and frac < 1.0:
            return
        self.last = now
        n = int(30 * frac)
        sys.stderr.write(f"\rtiming [{'#' * n}{'.' * (30 - n)}] {100 * frac:3.0f}%")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")
