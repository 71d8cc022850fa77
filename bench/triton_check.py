"""Triton kernels on a GPU: correctness (the GPU tests) and speed against their torch peers.

    PYTHONPATH=. python bench/triton_check.py --out OUT_DIR [--budget 280]

1. runs ``pytest tests/kernels tests/build/test_autotune.py`` (on a GPU the small-shape tests
   run compiled, and the ``gpu``-marked tests check every kernel and tactic at realistic shapes);
2. times each Triton kernel against its torch equivalent at BERT-base (b64, s128) and
   ResNet-50 shapes in FP16 (GPU time replayed from a CUDA graph,
   ``triton.testing.do_bench_cudagraph``, median; every tactic, the best reported);
3. runs the autotuner on one GEMM node twice through a timing cache in OUT_DIR (the second run
   must time nothing).

Writes ``triton_check.json`` and ``triton_check.md`` to OUT_DIR. Every part runs in its own
try/except; parts that would start after ``--budget`` seconds are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()


def _elapsed() -> float:
    return time.perf_counter() - T0


def run_tests(out: Path, timeout: int) -> dict:
    import importlib.util

    xml = out / "triton_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "tests/build/test_autotune.py",
           "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    if importlib.util.find_spec("xdist") is not None:  # kernels compile in parallel
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    env = dict(os.environ, TRITON_INTERPRET="0")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    tail = [ln for ln in (p.stdout + p.stderr).strip().splitlines() if "Warning" not in ln]
    res = {"rc": p.returncode, "summary": f"pytest exit code {p.returncode}", "tail": tail[-40:]}
    if xml.exists():
        import xml.etree.ElementTree as ET

        root = ET.parse(xml).getroot()
        suite = next(root.iter("testsuite"))
        res["summary"] = ", ".join(f"{suite.get(k)} {k}" for k in
                                   ("tests", "failures", "errors", "skipped"))
        res["failed"] = [c.get("name") for c in root.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
    return res


def _bench(fn, rep=50) -> float:
    """GPU time of ``fn`` in ms (median), replayed from a CUDA graph as the engine runs it:
    Python launch overhead (15-100 us per call here) is left out for Triton and torch alike."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except RuntimeError:
        import torch

        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _best(kernel_fn, n, tactics, args) -> tuple[float, dict | None, int]:
    """(ms, tactic) of the fastest tactic; tactics that fail to compile or run are skipped."""
    best, pick, failed = float("inf"), None, 0
    for t in [None, *tactics]:
        n.tactic, n.cache = t, {}
        try:
            ms = _bench(lambda: kernel_fn(n, *args), rep=20)
        except Exception:
            failed += 1
            continue
        if ms < best:
            best, pick = ms, t
    return best, pick, failed


def time_kernels(budget: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kiln.kernels.registry import Call
    from kiln.kernels.triton import attention as A
    from kiln.kernels.triton import gemm as G
    from kiln.kernels.triton import norm
    from kiln.kernels.triton import pointwise as P
    from kiln.kernels.triton import softmax as S
    from kiln.ops import fused_conv as FC
    from kiln.ops import fused_transformer as FT
    from kiln.ops import nn as N

    dev, h = "cuda", torch.float16
    rows: list[dict] = []

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=h)

    def part(name, shape, fn):
        if _elapsed() > budget:
            rows.append({"kernel": name, "shape": shape, "skipped": "time budget"})
            return
        try:
            triton_ms, torch_ms, extra = fn()
            rows.append({"kernel": name, "shape": shape, "triton_ms": triton_ms,
                         "torch_ms": torch_ms, "speedup": torch_ms / triton_ms, **extra})
        except Exception as e:
            rows.append({"kernel": name, "shape": shape, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1], default=str)[:300], flush=True)

    def call(op, **kw):
        return Call(op.make_attrs(**kw), 1, 4)

    def ln():
        x, w, b = rnd(8192, 768), rnd(768), rnd(768)
        n = call(N.LayerNormalization)
        ms, t, _ = _best(norm.layer_norm, n, norm.tactics(n, (x, w, b)), (x, w, b))
        return ms, _bench(lambda: F.layer_norm(x, (768,), w, b)), {"tactic": t}

    def rms():
        x, w = rnd(8192, 768), rnd(768)
        n = call(N.RMSNormalization)
        ms, t, _ = _best(norm.rms_norm, n, norm.tactics(n, (x, w)), (x, w))

        def eager():
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w).half()
        return ms, _bench(eager), {"tactic": t, "torch": "eager fp32 formula"}

    def softmax():
        x = rnd(64, 12, 128, 128)
        n = call(N.Softmax)
        ms, t, _ = _best(S.softmax, n, S.tactics(n, (x,)), (x,))
        return ms, _bench(lambda: torch.softmax(x, -1)), {"tactic": t}

    def bias_gelu():
        x, b = rnd(8192, 3072), rnd(3072)
        p = P.Program.from_json([["Add", ["i0", "i1"]], ["Erf", ["s0"]]], 2)
        ms = min(_bench(lambda t=t: P.run(p, [x, b], [h], t)) for t in P.TACTICS)
        return ms, _bench(lambda: torch.erf(x + b)), {"torch": "eager add, erf (2 kernels)"}

    def bn_res_relu():
        x, r = rnd(32, 256, 56, 56), rnd(32, 256, 56, 56)
        sc, sh = rnd(256, 1, 1), rnd(256, 1, 1)
        p = P.Program.from_json([["Mul", ["i0", "i1"]], ["Add", ["s0", "i2"]],
                                 ["Add", ["s1", "i3"]], ["Relu", ["s2"]]], 4)
        ms = min(_bench(lambda t=t: P.run(p, [x, sc, sh, r], [h], t)) for t in P.TACTICS)
        return ms, _bench(lambda: torch.relu(x * sc + sh + r)), {"torch": "eager, 4 kernels"}

    def gemm(m, k, nn, act, res):
        def fn():
            x, w, b = rnd(m, k), rnd(k, nn) / k ** 0.5, rnd(nn)
            r = rnd(m, nn) if res else None
            n = call(FC.FusedMatMul, activation=act, has_residual=int(res))
            args = (x, w, b, r)
            ms, t, failed = _best(G.fused_matmul, n, G.gemm_tactics(m, nn, k), args)
            wt = w.t().contiguous()

            def eager():
                y = F.linear(x, wt, b)
                y = y + r if r is not None else y
                return F.gelu(y) if act == "Gelu" else y
            plain = _bench(lambda: F.linear(x, wt, b))
            return ms, _bench(eager), {"tactic": t, "failed_tactics": failed,
                                       "cublas_linear_only_ms": plain,
                                       "tflops": 2 * m * nn * k / ms / 1e9}
        return fn

    def attention(b, s, causal):
        def fn():
            q, k, v = rnd(b, s, 768), rnd(b, s, 768), rnd(b, s, 768)
            mask = rnd(b, 1, 1, s)
            n = call(FT.Attention, num_heads=12, scale=64 ** -0.5, causal=causal)
            args = (q, k, v, mask)
            ms, t, failed = _best(A.attention, n, A.tactics(n, args), args)
            from kiln.kernels.torch import fused_transformer as TFT

            ref = _bench(lambda: TFT.attention(call(FT.Attention, num_heads=12,
                                                    scale=64 ** -0.5, causal=causal), *args))
            return ms, ref, {"tactic": t, "failed_tactics": failed, "torch": "SDPA"}
        return fn

    part("TritonLayerNorm", "8192x768", ln)
    part("TritonRMSNorm", "8192x768", rms)
    part("TritonSoftmax", "64x12x128x128", softmax)
    part("TritonPointwise bias+erf", "8192x3072", bias_gelu)
    part("TritonPointwise bn+res+relu", "32x256x56x56", bn_res_relu)
    for m, k, nn, act, res in ((8192, 768, 2304, "", False), (8192, 768, 3072, "Gelu", False),
                               (8192, 3072, 768, "", True), (128, 768, 3072, "Gelu", False),
                               (100352, 256, 64, "", False)):
        part("TritonFusedMatMul" + (f"+{act}" if act else "") + ("+res" if res else ""),
             f"{m}x{k}x{nn}", gemm(m, k, nn, act, res))
    part("TritonFlashAttention mask", "b64 h12 s128 d64", attention(64, 128, 0))
    part("TritonFlashAttention causal", "b64 h12 s128 d64", attention(64, 128, 1))
    part("TritonFlashAttention mask", "b1 h12 s512 d64", attention(1, 512, 0))
    return rows


def autotune_twice(out: Path) -> dict:
    import torch

    from kiln.builder.autotune import TimingCache, candidates, cuda_timer, device_key, select
    from kiln.kernels.registry import Call
    from kiln.ops import fused_conv as FC

    x = torch.randn(8192, 768, device="cuda", dtype=torch.float16)
    w = torch.randn(768, 3072, device="cuda", dtype=torch.float16) / 28
    b = torch.randn(3072, device="cuda", dtype=torch.float16)
    call = Call(FC.FusedMatMul.make_attrs(activation="Gelu"), 1, 4)
    path = out / "timing_cache.json"
    res = {}
    for run in ("first", "second"):
        cache = TimingCache(path, device_key())
        t0 = time.perf_counter()
        sel = select("ffn1", FC.FusedMatMul, call, (x, w, b, None),
                     candidates(FC.FusedMatMul, call, (x, w, b, None)), cuda_timer(),
                     cache)
        cache.save()
        res[run] = dict(sel.to_json(), seconds=time.perf_counter() - t0, line=sel.line())
        res[run]["cache_hits"] = cache.hits
    return res


def markdown(report: dict) -> str:
    lines = ["# Triton kernels on " + report.get("device", "?"), "",
             f"tests: `{report.get('tests', {}).get('summary', report.get('tests'))}`", ""]
    failed = report.get("tests", {}).get("failed")
    if failed:
        lines += ["failed tests: " + ", ".join(failed), ""]
    lines += ["| kernel | shape | Triton ms | torch ms | torch/Triton | tactic / note |",
              "|---|---|---|---|---|---|"]
    for r in report.get("timings", []):
        if "triton_ms" in r:
            note = r.get("tactic") or r.get("torch") or ""
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['triton_ms']:.4f} | "
                         f"{r['torch_ms']:.4f} | {r['speedup']:.2f}x | {note} |")
        else:
            lines.append(f"| {r['kernel']} | {r['shape']} | - | - | - | "
                         f"{r.get('error', r.get('skipped', ''))[:120]} |")
    at = report.get("autotune")
    if isinstance(at, dict) and "first" in at:
        lines += ["", "autotune: " + at["first"]["line"],
                  f"first run timed {at['first']['timed']} in {at['first']['seconds']:.1f} s; "
                  f"second run timed {at['second']['timed']}, cached {at['second']['cached']}"]
    lines += ["", f"total {report.get('seconds', 0):.0f} s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_INTERPRET"] = "0"
    report: dict = {}
    try:
        import torch
        import triton

        report.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=triton.__version__)
    except Exception as e:
        report["setup_error"] = repr(e)
    for key, fn in (("tests", lambda: run_tests(out, int(0.45 * args.budget))),
                    ("timings", lambda: time_kernels(0.85 * args.budget)),
                    ("autotune", lambda: autotune_twice(out))):
        if _elapsed() > args.budget:
            report[key] = {"skipped": "time budget"}
            continue
        try:
            report[key] = fn()
        except Exception as e:
            report[key] = {"error": f"{type(e).__name__}: {e}",
                           "trace": traceback.format_exc()[-2000:]}
        (out / "triton_check.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = _elapsed()
    (out / "triton_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "triton_check.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
