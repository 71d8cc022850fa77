"""CPU FP32 GEMM check (issue 5): GFLOP/s of the GEMMs within kiln's reach on the transformer
shapes, with onnxruntime's MatMul (MLAS) as the yardstick.

    python -m bench.cpu_gemm_check [--threads 1,2] [--m 128,1024] [--shapes 768x768,768x2304]
        [--candidates torch.linear,numpy.openblas] [--budget 2] [--env MKL_ENABLE_INSTRUCTIONS=AVX2]
        [--out FILE.json]

``y[M, N] = x[M, K] @ W`` for M in ``--m`` (batch x sequence: 128 and 1024 are b1/b8 at s128)
and (K, N) in ``--shapes`` (BERT-base/GPT-2, MiniLM, GPT-2's LM head). The candidates:

- ``torch.linear``: ``F.linear(x, W^T)``, MKL sgemm (kiln's ``linear`` tactic);
- ``torch.mm``: ``torch.mm(x, W)``, MKL sgemm on the [K, N] weight (no tactic of kiln's);
- ``torch.mkl_packed``: ``torch.ops.mkl._mkl_linear`` on a weight packed for M (``mkl``);
- ``torch.onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a reordered weight (``onednn``);
- ``numpy.openblas`` / ``numpy.openblas_nt``: ``numpy.matmul`` (numpy's bundled OpenBLAS) into a
  preallocated output, on ``W`` [K, N] / on the transposed view of ``W^T`` [N, K]; torch tensors
  shared zero-copy through ``Tensor.numpy()``;
- ``scipy.openblas``: ``scipy.linalg.blas.sgemm`` (scipy's own OpenBLAS), on Fortran views;
- ``blis``: ``blis.py.gemm`` (the ``blis`` package), where it is installed;
- ``ort.matmul``: a one-node ONNX MatMul with ``W`` an initializer, onnxruntime's CPU provider,
  default optimizations, ``intra_op_num_threads`` = threads (the yardstick, never a kiln path).

Threads: ``torch.set_num_threads`` for torch, ``threadpoolctl`` (BLAS API) for OpenBLAS. Each
``--env NAME=VALUE`` runs the torch candidates again in a child process with that variable set
(MKL reads its environment once, at load), reported as ``name[NAME=VALUE]``.

Per shape and thread count every candidate is checked against ``F.linear`` (max |diff| /
max |ref| <= 1e-4, else it is reported as a mismatch and not timed), then all run interleaved,
round after round until ``--budget`` seconds are spent (at least 2 rounds): per candidate a
``--settle`` pause, one untimed call, then ``--reps`` timed calls. The pause matters: these
libraries each keep their own worker threads (torch/MKL/oneDNN: OpenMP; OpenBLAS: pthreads;
onnxruntime: its own pool), which spin-wait for a while after a call; on 2 cores a candidate
that starts while another pool still spins runs several times slower. The table shows GFLOP/s
of the fastest call (contention from other processes only adds time) and, in brackets, of the
median call.

``--mixed`` measures that contention instead of avoiding it: every timed call is preceded by
an OpenMP-parallel torch op (an in-place add on 1M floats, as an engine runs between GEMMs),
with no pause, and the GFLOP/s count the GEMM's flops over the time of both.

Found on the 2-core AMD EPYC dev machine (Zen 3, AVX2; torch 2.13 with MKL 2024.2 and oneDNN
3.12, numpy 2.4 with OpenBLAS 0.3.31, blis 1.3.4, onnxruntime 1.32): on the transformer shapes
but the LM head, kiln's pick per shape, numpy's OpenBLAS and onnxruntime's MatMul are within a
few percent of each other (geometric mean, 1 and 2 threads). OpenBLAS is still no kiln tactic:
its pthread pool and torch's OpenMP pool fight over the cores (``--mixed`` at 2 threads: its
median drops up to several times, while the torch candidates keep their speed).
The ``blis`` wheel runs its generic kernels on Zen 3 (its CPU check knows no family 19h), on one
thread (~20 GFLOP/s). ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``MKL_DYNAMIC=FALSE`` change nothing
measurable. The one clear gap is the LM head (768x50257): onnxruntime ~1.2x faster than oneDNN,
the fastest torch path (MKL is ~2x slower there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = ((768, 768), (768, 2304), (768, 3072), (3072, 768),
          (384, 384), (384, 1152), (384, 1536), (1536, 384), (768, 50257))
TOL = 1e-4
TORCH_CANDIDATES = ("torch.linear", "torch.mm", "torch.mkl_packed", "torch.onednn")


@dataclass
class Case:
    x: torch.Tensor  # [M, K]
    w: torch.Tensor  # [K, N], contiguous
    wt: torch.Tensor  # [N, K], contiguous (what kiln's tactics get)
    threads: int


def _torch_linear(c):
    return lambda: F.linear(c.x, c.wt)


def _torch_mm(c):
    return lambda: torch.mm(c.x, c.w)


def _torch_mkl(c):
    if not (torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")):
        return None
    m = c.x.shape[0]
    pk = torch.ops.mkl._mkl_reorder_linear_weight(c.wt, m)
    return lambda: torch.ops.mkl._mkl_linear(c.x, pk, c.wt, None, m)


def _torch_onednn(c):
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return None
    pd = torch.ops.mkldnn._reorder_linear_weight(c.wt, c.x.shape[0])
    return lambda: torch.ops.mkldnn._linear_pointwise(c.x, pd, None, "none", [], "")


def _numpy_matmul(w_np):
    def make(c):
        xn, wn = c.x.numpy(), w_np(c)

        def run():
            y = torch.empty(c.x.shape[0], wn.shape[1])
            np.matmul(xn, wn, out=y.numpy())
            return y
        return run
    return make


def _scipy_sgemm(c):
    try:
        from scipy.linalg import blas
    except ImportError:
        return None
    # (x W)^T = W^T x^T: C-order x and W read as Fortran arrays are x^T and W^T, and the
    # Fortran result is C-order x W; no copies
    xf, wf = c.x.numpy().T, c.w.numpy().T
    return lambda: torch.from_numpy(blas.sgemm(1.0, wf, xf).T)


def _blis(c):
    try:
        import blis.py
    except ImportError:
        return None
    xn, wn = c.x.numpy(), c.w.numpy()

    def run():
        y = torch.empty(c.x.shape[0], wn.shape[1])
        blis.py.gemm(xn, wn, out=y.numpy(), beta=0.0)  # (beta defaults to 1: y += x W)
        return y
    return run


def _ort_matmul(c):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = c.w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(c.w.numpy(), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 9)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = c.threads, 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    feeds = {"x": c.x.numpy()}
    return lambda: torch.from_numpy(sess.run(None, feeds)[0])


CANDIDATES = {
    "torch.linear": _torch_linear,
    "torch.mm": _torch_mm,
    "torch.mkl_packed": _torch_mkl,
    "torch.onednn": _torch_onednn,
    "numpy.openblas": _numpy_matmul(lambda c: c.w.numpy()),
    "numpy.openblas_nt": _numpy_matmul(lambda c: c.wt.numpy().T),
    "scipy.openblas": _scipy_sgemm,
    "blis": _blis,
    "ort.matmul": _ort_matmul,
}


class _Threads:
    """torch's and the BLAS libraries' thread counts, for the ``with`` block."""

    def __init__(self, n):
        self.n, self.limits = n, None

    def __enter__(self):
        torch.set_num_threads(self.n)
        try:
            from threadpoolctl import threadpool_limits
            self.limits = threadpool_limits(limits=self.n, user_api="blas")
        except ImportError:
            os.environ["OPENBLAS_NUM_THREADS"] = str(self.n)  # (read at load only)
        return self

    def __exit__(self, *exc):
        if self.limits is not None:
            self.limits.restore_original_limits()


def _with_torch_op(fn):
    buf = torch.zeros(1 << 20)

    def run():
        buf.add_(1.0)  # OpenMP-parallel in torch: its worker threads then spin for a while
        return fn()
    return run


def _timed(fns: dict, budget: float, reps: int, settle: float) -> dict:
    """name -> call times (s): interleaved rounds; each candidate waits ``settle`` seconds (the
    previous candidate's spinning threads go to sleep), runs once untimed, then ``reps`` timed."""
    times = {name: [] for name in fns}
    t_end, rounds = time.perf_counter() + budget, 0
    while rounds < 2 or time.perf_counter() < t_end:
        for name, fn in fns.items():
            time.sleep(settle)
            fn()
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def measure(m, k, n, threads, names, args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(k, n, generator=g) / k ** 0.5
    case = Case(x, w, w.t().contiguous(), threads)
    flop = 2.0 * m * k * n
    rows, fns = [], {}
    with _Threads(threads):
        ref = F.linear(x, case.wt)
        scale = float(ref.abs().max())
        for name in names:
            fn = CANDIDATES[name](case)
            row = {"m": m, "k": k, "n": n, "threads": threads, "candidate": name,
                   "mixed": args.mixed}
            rows.append(row)
            if fn is None:
                row["status"] = "unavailable"
                continue
            err = float((fn() - ref).abs().max()) / scale
            row["rel_err"] = err
            if not err <= TOL:
                row["status"] = f"mismatch {err:.1e}"
                continue
            row["status"], fns[name] = "ok", _with_torch_op(fn) if args.mixed else fn
        times = _timed(fns, args.budget, args.reps, 0.0 if args.mixed else args.settle)
    for row in rows:
        t = times.get(row["candidate"])
        if t:
            row.update(best_s=min(t), median_s=statistics.median(t), calls=len(t),
                       gflops=flop / min(t) / 1e9, gflops_median=flop / statistics.median(t) / 1e9)
    return rows


def _env_rows(args, env: str) -> list[dict]:
    """The torch candidates, measured in a child process with ``env`` (NAME=VALUE) set."""
    name, _, value = env.partition("=")
    cmd = [sys.executable, "-m", "bench.cpu_gemm_check", "--json-stdout",
           "--candidates", ",".join(TORCH_CANDIDATES), "--threads", args.threads,
           "--m", args.m, "--shapes", args.shapes, "--budget", str(args.budget),
           "--reps", str(args.reps), "--settle", str(args.settle)]
    if args.mixed:
        cmd.append("--mixed")
    out = subprocess.run(cmd, env={**os.environ, name: value}, capture_output=True, text=True,
                         check=True).stdout
    rows = json.loads(out)
    for row in rows:
        row["candidate"] += f"[{env}]"
    return rows


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    head = "| M | K | N | thr | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    keys = list(dict.fromkeys((r["m"], r["k"], r["n"], r["threads"]) for r in rows))
    by = {(r["m"], r["k"], r["n"], r["threads"], r["candidate"]): r for r in rows}
    for key in keys:
        cells = []
        for name in names:
            r = by.get((*key, name))
            if r is None:
                cells.append("")
            elif "gflops" in r:
                cells.append(f"{r['gflops']:.0f} ({r['gflops_median']:.0f})")
            else:
                cells.append(r["status"])
        lines.append("| " + " | ".join(str(v) for v in key) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


KILN_TACTICS = ("torch.linear", "torch.mkl_packed", "torch.onednn")  # what kiln times per shape


def _speedups(rows, threads, ref) -> dict:
    """candidate -> geometric mean over the shapes of its speed relative to ``ref(times)``
    (``times``: candidate -> best seconds on one shape; shapes where ``ref`` is None are left
    out)."""
    shapes: dict = {}
    for r in rows:
        if r["threads"] == threads and "best_s" in r:
            shapes.setdefault((r["m"], r["k"], r["n"]), {})[r["candidate"]] = r["best_s"]
    ratios: dict = {}
    for times in shapes.values():
        t_ref = ref(times)
        if t_ref is not None:
            for name, t in times.items():
                ratios.setdefault(name, []).append(t_ref / t)
    return {name: float(np.exp(np.mean(np.log(v)))) for name, v in ratios.items()}


def _kiln_best(times):
    got = [times[t] for t in KILN_TACTICS if t in times]
    return min(got) if len(got) == len(KILN_TACTICS) else None


def summary(rows: list[dict]) -> str:
    """Per thread count, each candidate's speed (geometric mean over the shapes) relative to
    onnxruntime's MatMul and to kiln's pick (the fastest of its tactics on each shape)."""
    lines = []
    for threads in sorted({r["threads"] for r in rows}):
        for label, ref in (("ort.matmul", lambda t: t.get("ort.matmul")),
                           ("kiln's best tactic", _kiln_best)):
            speed = _speedups(rows, threads, ref)
            if speed:
                cells = ", ".join(f"{name} {v:.2f}" for name, v in speed.items())
                lines.append(f"{threads} thread(s), speed vs {label} (geomean): {cells}")
    return "\n".join(lines)


def _ints(s):
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--m", default="128,1024")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,...")
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--budget", type=float, default=2.0, help="seconds per shape and threads")
    p.add_argument("--reps", type=int, default=2, help="timed calls per candidate and round")
    p.add_argument("--settle", type=float, default=0.2,
                   help="pause (s) before each candidate's calls in a round")
    p.add_argument("--mixed", action="store_true",
                   help="a torch op before every call, no pause (thread-pool contention)")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE (repeatable)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--json-stdout", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [c for c in args.candidates.split(",") if c]
    unknown = [c for c in names if c not in CANDIDATES]
    if unknown:
        p.error(f"unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    rows, load0 = [], os.getloadavg()[0]
    for k, n in shapes:
        for m in _ints(args.m):
            for threads in _ints(args.threads):
                rows += measure(m, k, n, threads, names, args)
                if not args.json_stdout:
                    print(f"  done M={m} K={k} N={n} threads={threads}", file=sys.stderr)
    for env in args.env:
        rows += _env_rows(args, env)
    if args.json_stdout:
        print(json.dumps(rows))
        return 0
    print(f"load average (1 min) before/after: {load0:.2f} / {os.getloadavg()[0]:.2f}")
    print(table(rows))
    print(summary(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "numpy": np.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
