"""Per-layer dispatch cost: a chain of many small ops, kiln against onnxruntime in one run.

    python -m bench.dispatch [--ops 1000] [--shape 1x16x8x8] [--runs 200]

The model is ``ops`` elementwise ops on one small tensor, each reading the previous result and
the one before it (so every value has two readers and no fusion merges them): the engine keeps
one layer per op, and its median latency over the layer count is what one layer costs to
dispatch (the arithmetic on 1,024 floats is a few nanoseconds). Prints kiln's and
onnxruntime's microseconds per layer and their ratio; both run on 2 threads.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.corpus.measure import median_s

_BINARY = ("Add", "Mul", "Max", "Sub")
_UNARY = ("Sigmoid", "Tanh", "Scale", "Relu")  # bounded: no overflow, no denormals


def chain_model(n_ops: int, shape: tuple[int, ...], seed: int = 0) -> onnx.ModelProto:
    """``n_ops`` alternating unary and binary ops; op i reads results i-1 and i-2."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev2, prev = "x", "x"
    for i in range(n_ops):
        out = f"v{i}"
        if i % 2:
            op = _BINARY[(i // 2) % len(_BINARY)]
            nodes.append(helper.make_node(op, [prev, prev2], [out], name=f"{op.lower()}{i}"))
        else:
            op = _UNARY[(i // 2) % len(_UNARY)]
            if op == "Scale":  # a constant operand, broadcast over H and W
                c = f"c{i}"
                inits.append(numpy_helper.from_array(
                    rng.uniform(0.5, 1.0, shape[1:2] + (1,) * (len(shape) - 2)).astype(
                        np.float32), c))
                nodes.append(helper.make_node("Mul", [prev, c], [out], name=f"scale{i}"))
            else:
                nodes.append(helper.make_node(op, [prev], [out], name=f"{op.lower()}{i}"))
        prev2, prev = prev, out
    nodes.append(helper.make_node("Add", [prev, prev2], ["y"], name="out"))
    g = helper.make_graph(nodes, "dispatch_chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--shape", default="1x16x8x8")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    # kiln before torch: kiln sets OpenMP's wait policy, which torch's import fixes
    import kiln  # noqa: I001
    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    shape = tuple(int(d) for d in args.shape.split("x"))
    model = chain_model(args.ops, shape)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chain.onnx"
        onnx.save(model, path)
        builder = kiln.Builder(kiln.BuilderConfig(device="cpu"))
        engine = builder.build(str(path))
        engine.save(Path(tmp) / "chain.kiln")
        engine = kiln.load(Path(tmp) / "chain.kiln")
        loop = kiln.load(Path(tmp) / "chain.kiln")  # the same engine on the Python loop
        for ex in loop._executors:
            ex.program = None
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    runs = {"kiln": engine.create_context(), "kiln, Python loop": loop.create_context()}
    runs = {k: (lambda c=c: c.run({"x": x})["y"]) for k, c in runs.items()}
    runs["onnxruntime"] = lambda: sess.run(None, {"x": x})[0]
    want = runs["onnxruntime"]()
    err = max(float(np.abs(runs[k]() - want).max() / max(1e-30, np.abs(want).max()))
              for k in ("kiln", "kiln, Python loop"))
    layers = len(engine.graph.nodes)
    best = {k: float("inf") for k in runs}
    for _ in range(2):  # interleaved twice, the better median of each kept
        for k, fn in runs.items():
            best[k] = min(best[k], median_s(fn, args.runs, warmup=5))
    print(f"chain of {args.ops} ops on {shape} -> {layers} kiln layers, max rel err {err:.1e} "
          f"(max |y| {np.abs(want).max():.3f}), {args.threads} threads")
    for k, t in best.items():
        per, unit = (layers, "layer") if k.startswith("kiln") else (args.ops + 1, "op")
        print(f"{k:18s} {1e3 * t:8.3f} ms  {1e6 * t / per:6.2f} us/{unit}"
              f"  {t / best['onnxruntime']:5.2f}x onnxruntime")
    return 0 if err <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
