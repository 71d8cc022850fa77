"""Loopback load test of ``kiln serve``: a real server in its own process, real tritonclient
clients (gRPC with asyncio, or HTTP with gevent; several processes), a bounded number of
requests per concurrency level, with and without dynamic batching, and the server's overhead
per request over ``ExecutionContext.run`` at batch 1 measured in the same run.

    python -m bench.serve_load --model mlp --concurrency 1,8,32 --requests 600      # CPU
    python -m bench.serve_load --model resnet50 --device cuda --fp16 \\
        --concurrency 1,8,32 --requests 4000 --max-batch 32 --instances 2 --client-procs 4

Every level reports requests sent, responses received, errors and wrong outputs (each
response is compared to the engine's own output for the same input), throughput and
p50/p90/p99 latency, and the mean batch the server ran (from its statistics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

MODES = {"batching": "dynamic batching", "nobatch": "batch-1 serving"}


def mlp_onnx(path: Path, width: int = 256, hidden: int = 1024) -> Path:
    """A small MLP (x @ W1 -> Relu -> @ W2), seeded: the CPU load test's model."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((width, hidden)) / 16).astype(
        np.float32), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((hidden, width)) / 32).astype(
        np.float32), "W2")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W1"], ["h"]), helper.make_node("Relu", ["h"],
                                                                             ["r"]),
         helper.make_node("MatMul", ["r", "W2"], ["output"])], "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", width])], [w1, w2])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def build_engine(args, work: Path):
    """The engine both served models use, built once; returns (path, sample input, input
    name, output name)."""
    import kiln
    from kiln.engine.profile import Profile

    if args.model == "mlp":
        onnx_path = mlp_onnx(work / "mlp.onnx", args.mlp_width, args.mlp_hidden)
        shape = (args.mlp_width,)
    else:
        from kiln.zoo import build_onnx

        onnx_path, shape = build_onnx(args.model), (3, 224, 224)
    profiles = []
    if args.device == "cuda":  # batch 1 tuned on its own, the batches the batcher makes apart
        one, big = (1, *shape), (args.max_batch, *shape)
        name = "input"  # the zoo's and mlp's input name
        profiles = [Profile.fixed({name: one}),
                    Profile({name: (2, *shape)}, {name: big}, {name: big})]
    cfg = kiln.BuilderConfig(device=args.device, fp16=args.fp16, profiles=profiles)
    print(f"building {onnx_path.name} ({args.device}{', fp16' if args.fp16 else ''}) ...",
          flush=True)
    engine = kiln.Builder(cfg).build(str(onnx_path))
    path = work / "model.kiln"
    engine.save(path)
    x = np.random.default_rng(1).standard_normal((1, *shape)).astype(np.float32)
    return path, x, engine.inputs[0].name, engine.outputs[0].name


def write_repository(args, engine: Path, shape, in_name: str, root: Path) -> None:
    """Two models on one engine: with dynamic batching, and without. Both warm every batch
    size they will run (model_warmup), so no request pays a first run at a new shape."""
    dims = ", ".join(map(str, shape))

    def warmup(sizes):
        return "".join(f'model_warmup [ {{ name: "b{b}" batch_size: {b} inputs {{ key: "{in_name}" '
                       f'value {{ data_type: TYPE_FP32 dims: [ {dims} ] zero_data: true }} }} '
                       f'}} ]\n' for b in sizes)

    batching = (f"dynamic_batching {{ max_queue_delay_microseconds: {args.delay_us} }}\n"
                + warmup(range(1, args.max_batch + 1)))
    groups = f"instance_group [ {{ count: {args.instances} }} ]\n"
    for name, extra in (("batching", batching), ("nobatch", warmup([1]))):
        d = root / name / "1"
        d.mkdir(parents=True)
        os.link(engine, d / "model.kiln") if _same_fs(engine, d) else shutil.copy(
            engine, d / "model.kiln")
        (root / name / "config.pbtxt").write_text(
            f"max_batch_size: {args.max_batch}\n{groups}{extra}")


def _same_fs(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repo: Path, http: int, grpc: int):
    cmd = [sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo), "--host",
           "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
           "0", "--grace-period", "5"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kiln serve exited: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("kiln serve did not become ready in 600 s")


def direct_latency(engine: Path, x: np.ndarray, names, n: int) -> tuple[float, np.ndarray]:
    """Median seconds of ExecutionContext.run at batch 1 (numpy in, numpy out), and the
    reference output."""
    import kiln

    ctx = kiln.load(engine).create_context()
    i, o = names
    for _ in range(10):
        ref = ctx.run({i: x})[o]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ctx.run({i: x})
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), np.asarray(ref)


def _client_proc(url, model, names, x, ref, n, conc, warmup, out_q):
    """One client process: ``conc`` coroutines share ``n`` requests; puts its counts."""
    import tritonclient.grpc.aio as grpcclient

    async def main():
        client = grpcclient.InferenceServerClient(url)
        lat, errors, wrong, sent = [], [], 0, 0
        budget = {"left": warmup + n}

        async def worker():
            nonlocal wrong, sent
            while budget["left"] > 0:
                budget["left"] -= 1
                measured = budget["left"] < n
                inp = grpcclient.InferInput(names[0], list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                sent += measured
                t0 = time.perf_counter()
                try:
                    r = await client.infer(model, [inp])
                    y = r.as_numpy(names[1])
                except Exception as e:  # counted and reported
                    errors.append(str(e)[:200])
                    continue
                dt = time.perf_counter() - t0
                if measured:
                    lat.append(dt)
                    scale = float(np.abs(ref).max()) or 1.0
                    if y.shape != ref.shape or float(np.abs(y - ref).max()) > 2e-2 * scale:
                        wrong += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
        await client.close()
        return {"lat": lat, "errors": errors, "wrong": wrong, "sent": sent, "wall": wall}

    out_q.put(asyncio.run(main()))


def _http_client_proc(url, model, names, x, ref, n, conc, warmup, out_q):
    """As :func:`_client_proc`, with tritonclient.http (gevent greenlets, binary data)."""
    import gevent.pool
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, concurrency=conc, network_timeout=600)
    lat, errors, counts = [], [], {"wrong": 0, "sent": 0, "left": warmup + n}

    def worker():
        while counts["left"] > 0:
            counts["left"] -= 1
            measured = counts["left"] < n
            inp = httpclient.InferInput(names[0], list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            counts["sent"] += measured
            t0 = time.perf_counter()
            try:
                y = client.infer(model, [inp]).as_numpy(names[1])
            except Exception as e:  # counted and reported
                errors.append(str(e)[:200])
                continue
            if measured:
                lat.append(time.perf_counter() - t0)
                scale = float(np.abs(ref).max()) or 1.0
                if y.shape != ref.shape or float(np.abs(y - ref).max()) > 2e-2 * scale:
                    counts["wrong"] += 1

    t0 = time.perf_counter()
    pool = gevent.pool.Pool(conc)
    for _ in range(conc):
        pool.spawn(worker)
    pool.join()
    wall = time.perf_counter() - t0
    client.close()
    out_q.put({"lat": lat, "errors": errors, "wrong": counts["wrong"], "sent": counts["sent"],
               "wall": wall})


def server_stats(http: int, model: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{model}/stats") as r:
        st = json.load(r)["model_stats"][0]
    return st["inference_count"], st["execution_count"]


def run_level(args, grpc_url, http, model, names, x, ref, conc) -> dict:
    procs = max(1, min(args.client_procs, conc))
    q = mp.get_context("spawn").Queue()
    shares = [conc // procs + (i < conc % procs) for i in range(procs)]
    reqs = [args.requests * s // conc for s in shares]
    reqs[0] += args.requests - sum(reqs)
    warm = max(2 * conc, 20)
    inf0, ex0 = server_stats(http, model)
    target, url = ((_http_client_proc, f"127.0.0.1:{http}") if args.protocol == "http"
                   else (_client_proc, grpc_url))
    ps = [mp.get_context("spawn").Process(target=target, args=(
        url, model, names, x, ref, r, s, warm * s // conc, q)) for r, s in zip(reqs, shares)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    parts = [q.get(timeout=args.level_timeout) for _ in ps]
    for p in ps:
        p.join(30)
    wall = max(p["wall"] for p in parts)
    inf1, ex1 = server_stats(http, model)
    lat = np.array(sum((p["lat"] for p in parts), [])) * 1e3
    errors = sum((p["errors"] for p in parts), [])
    received = len(lat)
    row = {"mode": model, "concurrency": conc, "sent": sum(p["sent"] for p in parts),
           "received": received, "errors": len(errors), "wrong": sum(p["wrong"] for p in parts),
           "throughput": received / wall if wall else 0.0,
           "p50_ms": float(np.percentile(lat, 50)) if received else None,
           "p90_ms": float(np.percentile(lat, 90)) if received else None,
           "p99_ms": float(np.percentile(lat, 99)) if received else None,
           "mean_batch": (inf1 - inf0) / (ex1 - ex0) if ex1 > ex0 else None,
           "first_errors": errors[:3], "elapsed_s": time.perf_counter() - t0}
    return row


def report(rows, direct_ms, args) -> dict:
    print(f"\nkiln serve load test: {args.model} on {args.device}"
          f"{' fp16' if args.fp16 else ''}, {args.protocol} over loopback, {args.requests} "
          f"requests per "
          f"level, max batch {args.max_batch}, queue delay {args.delay_us} us, "
          f"{args.instances} instance(s)\n")
    print("| mode | conc | sent | recv | errors | wrong | req/s | p50 ms | p90 ms | p99 ms | "
          "mean batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(v, fmt):
            return "-" if v is None else format(v, fmt)
        print(f"| {MODES[r['mode']]} | {r['concurrency']} | {r['sent']} | {r['received']} | "
              f"{r['errors']} | {r['wrong']} | {r['throughput']:.1f} | {f(r['p50_ms'], '.2f')} | "
              f"{f(r['p90_ms'], '.2f')} | {f(r['p99_ms'], '.2f')} | "
              f"{f(r['mean_batch'], '.2f')} |")
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    summary = {"direct_run_p50_ms": direct_ms}
    print(f"\nExecutionContext.run at batch 1 (same engine, in process; the faster of the runs "
          f"before and after the load): p50 {direct_ms:.3f} ms")
    one = by.get(("nobatch", 1))
    if one and one["p50_ms"] is not None:
        summary["overhead_ms"] = one["p50_ms"] - direct_ms
        print(f"server overhead per request at batch 1 (p50 over {args.protocol} at concurrency 1 "
              f"minus "
              f"ExecutionContext.run p50): {summary['overhead_ms']:.3f} ms")
    for c in args.concurrency:
        b, n = by.get(("batching", c)), by.get(("nobatch", c))
        if b and n and n["throughput"] and n["p99_ms"]:
            summary[f"c{c}"] = {"throughput_ratio": b["throughput"] / n["throughput"],
                                "p99_ratio": b["p99_ms"] / n["p99_ms"]}
            print(f"concurrency {c}: dynamic batching {b['throughput'] / n['throughput']:.2f}x "
                  f"the requests/s of batch-1 serving, p99 {b['p99_ms'] / n['p99_ms']:.2f}x")
    ok = all(r["sent"] == r["received"] and r["errors"] == 0 and r["wrong"] == 0 for r in rows)
    print(f"\nsent == received, errors = 0, wrong = 0 on every level: {'yes' if ok else 'NO'}")
    return {"rows": rows, "summary": summary, "ok": ok, "args": vars(args)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", help="mlp (small, built here) or a kiln.zoo "
                   "model with a dynamic batch and input named 'input' (resnet50)")
    p.add_argument("--mlp-width", type=int, default=256, help="mlp: input/output features")
    p.add_argument("--mlp-hidden", type=int, default=1024, help="mlp: hidden features")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--concurrency", default="1,8,32",
                   type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--requests", type=int, default=600, help="measured requests per level")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=500, help="max queue delay of the batcher")
    p.add_argument("--instances", type=int, default=1, help="execution contexts per model")
    p.add_argument("--client-procs", type=int, default=2, help="client processes")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"],
                   help="tritonclient.grpc (asyncio) or tritonclient.http (binary data)")
    p.add_argument("--no-batching", action="store_true", help="only batch-1 serving")
    p.add_argument("--batching-only", action="store_true", help="only dynamic batching")
    p.add_argument("--direct-runs", type=int, default=200)
    p.add_argument("--level-timeout", type=float, default=600)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    modes = ["nobatch"] if args.no_batching else ["batching"] if args.batching_only else \
        ["batching", "nobatch"]
    work = Path(tempfile.mkdtemp(prefix="kiln-serve-load-"))
    try:
        engine, x, *names = build_engine(args, work)
        direct_s, ref = direct_latency(engine, x, names, args.direct_runs)
        write_repository(args, engine, x.shape[1:], names[0], work / "repo")
        http, grpc = free_port(), free_port()
        server = start_server(work / "repo", http, grpc)
        rows = []
        try:
            for mode in modes:
                for c in args.concurrency:
                    rows.append(run_level(args, f"127.0.0.1:{grpc}", http, mode, names, x, ref,
                                          c))
                    r = rows[-1]
                    print(f"  {mode} c={c}: {r['throughput']:.1f} req/s, p99 {r['p99_ms']} ms, "
                          f"errors {r['errors']}", flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            rc = server.wait(60)
        after_s, _ = direct_latency(engine, x, names, args.direct_runs)  # the machine may
        result = report(rows, min(direct_s, after_s) * 1e3, args)  # have changed: the faster
        result["server_exit_code"] = rc
        print(f"server exit code after SIGTERM: {rc}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0 if result["ok"] and rc == 0 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
