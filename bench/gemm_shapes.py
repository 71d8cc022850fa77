"""kiln's CPU GEMM against onnxruntime on one MatMul + Add of a given shape, in one process.

    python -m bench.gemm_shapes [MxKxN ...] [--threads 2] [--runs 30] [--repeats 3]

For each shape (default: the transformer encoders' GEMMs, M = 128 and 197 rows against K x N
weights of 768 x 768/2304/3072 and 3072 x 768) builds a two-node ONNX model (MatMul by a
constant [K, N] weight, Add of a constant bias) for onnxruntime, and the same product through
:func:`kiln.native.gemm_fn` (the weight packed once), checks that the two agree, and prints both
medians in microseconds and the kiln/onnxruntime ratio over ``repeats`` interleaved rounds
(lowest-highest). onnxruntime runs without spinning, as ``bench.corpus --omp-wait-policy
passive`` runs kiln.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from bench.corpus.measure import median_s
from kiln import native

DEFAULT = ("128x768x768", "128x768x3072", "128x3072x768", "197x768x768", "197x768x2304",
           "197x768x3072", "197x3072x768")


def matmul_add_model(w: np.ndarray, b: np.ndarray, m: int) -> bytes:
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y0"]),
         helper.make_node("Add", ["y0", "b"], ["y"])],
        "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=list(DEFAULT), help="MxKxN")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if native.why_not:
        raise SystemExit(f"kiln's native kernels are not available: {native.why_not}")
    torch.set_num_threads(args.threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for shape in args.shapes:
        m, k, n = (int(d) for d in shape.split("x"))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        b = rng.standard_normal(n, dtype=np.float32)
        sess = ort.InferenceSession(matmul_add_model(w, b, m), so,
                                    providers=["CPUExecutionProvider"])
        run = native.gemm_fn(native.PackedWeight(torch.from_numpy(w)), torch.from_numpy(b))
        xt, out = torch.from_numpy(x), torch.empty(m, n)
        ref = sess.run(None, {"x": x})[0]
        run(xt, None, out)
        err = float(np.abs(out.numpy() - ref).max())
        if not np.allclose(out.numpy(), ref, rtol=1e-4, atol=1e-3 * np.sqrt(k)):
            raise SystemExit(f"{shape}: kiln and onnxruntime differ by {err:.3g}")
        ratios, tk, to = [], 0.0, 0.0
        for _ in range(args.repeats):
            tk = 1e6 * median_s(lambda r=run, a=xt, o=out: r(a, None, o), args.runs, warmup=5)
            to = 1e6 * median_s(lambda s=sess, a=x: s.run(None, {"x": a}), args.runs, warmup=5)
            ratios.append(tk / to)
        print(f"{shape}: kiln {tk:.0f} us, onnxruntime {to:.0f} us, kiln/ort "
              f"{min(ratios):.2f}-{max(ratios):.2f} (max |diff| {err:.2g})", flush=True)


if __name__ == "__main__":
    main()
