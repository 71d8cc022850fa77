"""FusedConv on CUDA, FP16 channels-last: the PyTorch kernel against TritonFusedConv's tactics
at ResNet-50's layer shapes.

    PYTHONPATH=. python bench/conv_epilogue_check.py --out DIR [--batches 256,1] [--rep 50]

For each distinct FusedConv of ResNet-50 (torchvision's v1.5 at 224x224: the 7x7 stem, the
1x1 and 3x3 convs with Relu, the block-closing 1x1 with the residual add, the downsample 1x1
without activation) and each batch, runs every candidate on the same inputs:

- ``torch``: the PyTorch kernel (cuDNN conv with bias, then PyTorch's bias, residual and
  activation passes);
- ``conv_only``: the channels-last conv without bias and nothing after it (the floor);
- each tactic of ``kiln.kernels.triton.conv.tactics`` (Triton epilogue, cuDNN fused).

``cold_ms``: wall time of a candidate's first call (synchronized), in the order above. cuDNN's
plan for the conv is made by the first call on a shape (PyTorch adds the bias as a separate
kernel, so the torch kernel's conv is the one the Triton tactics run); the cuDNN tactic builds
plans of its own; a Triton tactic's first call also compiles its epilogue for that
specialization. ``ms``: median GPU time replayed from a CUDA graph
(``triton.testing.do_bench_cudagraph``; plain ``do_bench`` where capture fails). Every output is
checked against the torch kernel's at the autotuner's tolerance. ``totals``: per batch, the sum
over ResNet-50's 53 convs (count x ms) for the torch kernel, each tactic, and the fastest
correct candidate per layer. A candidate that raises is recorded with its error. Writes
``conv_epilogue_check.json`` to DIR.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.builder.autotune import TOLERANCE
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as torch_fused
from kiln.kernels.triton import conv
from kiln.ops import fused_conv as FC
from kiln.settings import SETTINGS

CL = torch.channels_last
T0 = time.perf_counter()

# (name, in channels, out channels, kernel, stride, input H=W, activation, residual, count)
LAYERS = (
    ("stem7x7", 3, 64, 7, 2, 224, "Relu", False, 1),
    ("l1.1x1a", 64, 64, 1, 1, 56, "Relu", False, 1),
    ("l1.1x1", 256, 64, 1, 1, 56, "Relu", False, 2),
    ("l1.3x3", 64, 64, 3, 1, 56, "Relu", False, 3),
    ("l1.1x1res", 64, 256, 1, 1, 56, "Relu", True, 3),
    ("l1.down", 64, 256, 1, 1, 56, "", False, 1),
    ("l2.1x1a", 256, 128, 1, 1, 56, "Relu", False, 1),
    ("l2.3x3s2", 128, 128, 3, 2, 56, "Relu", False, 1),
    ("l2.1x1", 512, 128, 1, 1, 28, "Relu", False, 3),
    ("l2.3x3", 128, 128, 3, 1, 28, "Relu", False, 3),
    ("l2.1x1res", 128, 512, 1, 1, 28, "Relu", True, 4),
    ("l2.down", 256, 512, 1, 2, 56, "", False, 1),
    ("l3.1x1a", 512, 256, 1, 1, 28, "Relu", False, 1),
    ("l3.3x3s2", 256, 256, 3, 2, 28, "Relu", False, 1),
    ("l3.1x1", 1024, 256, 1, 1, 14, "Relu", False, 5),
    ("l3.3x3", 256, 256, 3, 1, 14, "Relu", False, 5),
    ("l3.1x1res", 256, 1024, 1, 1, 14, "Relu", True, 6),
    ("l3.down", 512, 1024, 1, 2, 28, "", False, 1),
    ("l4.1x1a", 1024, 512, 1, 1, 14, "Relu", False, 1),
    ("l4.3x3s2", 512, 512, 3, 2, 14, "Relu", False, 1),
    ("l4.1x1", 2048, 512, 1, 1, 7, "Relu", False, 2),
    ("l4.3x3", 512, 512, 3, 1, 7, "Relu", False, 2),
    ("l4.1x1res", 512, 2048, 1, 1, 7, "Relu", True, 3),
    ("l4.down", 1024, 2048, 1, 2, 14, "", False, 1),
)
assert sum(layer[-1] for layer in LAYERS) == 53


def label(t: dict | None) -> str:
    if not t:
        return "torch"
    if t.get("epilogue") == "cudnn":
        return "cudnn"
    return f"triton[{t['BLOCK']},{t['num_warps']}]"


def bench_ms(fn, rep: int) -> tuple[float, str]:
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=rep, return_mode="median")), "cudagraph"
    except RuntimeError:
        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=10, rep=rep, return_mode="median")), "do_bench"


def cold_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def inputs(layer, batch: int):
    _, cin, cout, k, s, hw, act, res, _ = layer
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).half()

    x = rnd(batch, cin, hw, hw).contiguous(memory_format=CL)
    w = rnd(cout, cin, k, k, scale=(cin * k * k) ** -0.5)
    b = rnd(cout, scale=0.1)
    attrs = {"pads": [k // 2] * 4, "strides": [s, s], "activation": act, "has_residual": int(res)}
    out_hw = (hw + 2 * (k // 2) - k) // s + 1
    r = rnd(batch, cout, out_hw, out_hw).contiguous(memory_format=CL) if res else None
    return attrs, (x, w, b, r)


def check(y, want) -> tuple[bool, float]:
    atol, rtol = TOLERANCE[torch.float16]
    err = float((y.float() - want.float()).abs().max())
    ok = y.shape == want.shape and torch.allclose(y.float(), want.float(), atol=atol, rtol=rtol)
    return bool(ok), err


def run_layer(layer, batch: int, rep: int) -> dict:
    attrs, args = inputs(layer, batch)
    x, w, b, r = args
    row = {"layer": layer[0], "batch": batch, "count": layer[-1], "x": list(x.shape),
           "w": list(w.shape), "activation": attrs["activation"], "residual": r is not None,
           "candidates": {}}
    node = Call(FC.FusedConv.make_attrs(**attrs), 1, 4)
    space = conv.tactics(node, args)
    want = None
    pad, stride = attrs["pads"][:2], attrs["strides"]
    wcl = w.contiguous(memory_format=CL)
    cands = [("torch", lambda n: torch_fused.fused_conv(n, *args), None),
             ("conv_only", lambda n: F.conv2d(x, wcl, None, stride, pad), None)]
    cands += [(label(t), lambda n: conv.fused_conv(n, *args), t) for t in space]
    for name, fn, tactic in cands:
        res = row["candidates"][name] = {"tactic": tactic}
        call = functools.partial(fn, Call(node.attrs, 1, 4, tactic=tactic))
        try:
            with torch.inference_mode():
                res["cold_ms"] = cold_ms(call)
                y = call()
                if name == "torch":
                    want = y
                elif name != "conv_only" and want is not None:
                    res["ok"], res["max_err"] = check(y, want)
                del y
                res["ms"], res["timer"] = bench_ms(call, rep)
        except Exception as e:  # a failing candidate is a result, not the end of the run
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["trace"] = traceback.format_exc()[-1200:]
            torch.cuda.synchronize()
    good = {k: v["ms"] for k, v in row["candidates"].items()
            if "ms" in v and k != "conv_only" and (k == "torch" or v.get("ok"))}
    if good:
        row["best"] = min(good, key=good.get)
        if "torch" in good:
            row["speedup"] = good["torch"] / good[row["best"]]
    return row


def totals(rows: list[dict]) -> dict:
    out: dict = {}
    for batch in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == batch and "best" in r]
        sums: dict = {}
        for r in rs:
            for k, v in r["candidates"].items():
                if "ms" in v and k != "conv_only":
                    sums[k] = sums.get(k, 0.0) + r["count"] * v["ms"]
        best = sum(r["count"] * r["candidates"][r["best"]]["ms"] for r in rs)
        conv_only = sum(r["count"] * r["candidates"]["conv_only"].get("ms", float("nan"))
                        for r in rs)
        out[str(batch)] = {"layers": len(rs), "per_candidate_ms": sums, "best_per_layer_ms": best,
                           "conv_only_ms": conv_only,
                           "note": "candidates missing on some layers are summed over fewer"}
    return out


def fmt(v: dict | None, key: str = "ms") -> str:
    if v is None:
        return "-"
    if "error" in v:
        return "ERR"
    s = f"{v[key]:.3f}" if key in v else "-"
    return s + ("!" if v.get("ok") is False else "")


def print_table(rows: list[dict]) -> None:
    names = []
    for r in rows:
        names += [k for k in r["candidates"] if k not in names]
    print("ms (median GPU time; '!' = output differs from torch; ERR = raised)")
    print(f"{'layer':<10} {'batch':>5} " + " ".join(f"{k:>17}" for k in names) +
          f" {'best':>17} {'speedup':>7}")
    for r in rows:
        cells = " ".join(f"{fmt(r['candidates'].get(k)):>17}" for k in names)
        print(f"{r['layer']:<10} {r['batch']:>5} {cells} {r.get('best', '-'):>17} "
              f"{r.get('speedup', float('nan')):>7.2f}")
    print("cold first call, ms")
    for r in rows:
        cells = " ".join(f"{fmt(r['candidates'].get(k), 'cold_ms'):>17}" for k in names)
        print(f"{r['layer']:<10} {r['batch']:>5} {cells}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="256,1")
    p.add_argument("--rep", type=int, default=50, help="ms of timed replays per candidate")
    p.add_argument("--budget", type=float, default=500.0, help="seconds; later layers skipped")
    p.add_argument("--cudnn-benchmark", type=int, default=int(SETTINGS.cudnn_benchmark),
                   help="cuDNN autotuning, as engines run (default: KILN_CUDNN_BENCHMARK)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("conv_epilogue_check: no CUDA device")
        return 2
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = bool(args.cudnn_benchmark)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
            "cudnn_benchmark": bool(args.cudnn_benchmark), "rep_ms": args.rep}
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []
    for batch in (int(b) for b in args.batches.split(",")):
        for layer in LAYERS:
            if time.perf_counter() - T0 > args.budget:
                rows.append({"layer": layer[0], "batch": batch, "skipped": "time budget",
                             "candidates": {}})
                continue
            rows.append(run_layer(layer, batch, args.rep))
            r = rows[-1]
            print(f"{r['layer']} b{batch}: best {r.get('best')} "
                  f"x{r.get('speedup', float('nan')):.2f} "
                  + " ".join(f"{k}={fmt(v)}" for k, v in r["candidates"].items()), flush=True)
            torch.cuda.empty_cache()
    done = [r for r in rows if "skipped" not in r]
    print_table(done)
    res = {"meta": meta, "rows": rows, "totals": totals(done),
           "seconds": time.perf_counter() - T0}
    print(json.dumps(res["totals"], indent=1))
    (out / "conv_epilogue_check.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
