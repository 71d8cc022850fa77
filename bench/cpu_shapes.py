"""python -m bench.cpu_shapes: kiln's CPU conv and GEMM kernels against onnxruntime, per shape.

    python -m bench.cpu_shapes [--only conv|gemm] [--threads 2]

Each shape class under the corpus's CNNs and transformers (ResNet's 1x1, 3x3 and stride-2
convs and its 7x7 stem; BERT/ViT's GEMMs at M = 128 / 197; small-M GEMMs) as a one-node ONNX
model (Conv + Relu, or MatMul + Add) run by onnxruntime, against kiln's own kernel for it
(kiln.native: the GEMM for 1x1, Winograd for 3x3 stride 1, the direct conv (im2col + GEMM)
for the rest) and oneDNN through torch, on NHWC activations with the weight packed once,
timed interleaved in one process (fastest run of each: the machine may be shared;
onnxruntime's threads do not spin, which would take a core from the next system's run). Prints
microseconds, kiln / onnxruntime, and kiln's error against onnxruntime's output.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

CONVS = [  # C, K, H (= W), kernel, stride, pad: ResNet-18/50's layers at 224 x 224
    (3, 64, 224, 7, 2, 3),
    (64, 64, 56, 1, 1, 0), (64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 0), (256, 64, 56, 1, 1, 0),
    (128, 128, 56, 3, 2, 1), (256, 512, 56, 1, 2, 0), (128, 512, 28, 1, 1, 0),
    (512, 128, 28, 1, 1, 0), (128, 128, 28, 3, 1, 1), (256, 256, 28, 3, 2, 1),
    (256, 1024, 14, 1, 1, 0), (1024, 256, 14, 1, 1, 0), (256, 256, 14, 3, 1, 1),
    (512, 512, 14, 3, 2, 1), (512, 2048, 7, 1, 1, 0), (2048, 512, 7, 1, 1, 0),
    (512, 512, 7, 3, 1, 1), (64, 128, 56, 3, 2, 1),
]
GEMMS = [  # M, K, N: BERT (128) and ViT (197) tokens, a decode step, ConvNeXt's late MLPs
    (128, 768, 768), (128, 768, 3072), (128, 3072, 768), (197, 768, 768), (197, 768, 3072),
    (197, 3072, 768), (1, 768, 768), (1, 768, 3072), (16, 768, 768), (49, 320, 1280),
    (49, 1280, 320),
]


def _session(nodes, inputs, inits, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                       for n, s in inputs],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    # its pool spins after each run, into the next system's run (the runs alternate)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _time(fns: dict, budget_s: float = 0.3) -> dict:
    """The fastest run of each, interleaved."""
    for f in fns.values():
        f()
        f()
    t0 = time.perf_counter()
    next(iter(fns.values()))()
    reps = max(5, min(200, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def conv_case(c, k, h, ks, s, p, threads, rng):
    import torch
    from onnx import helper

    from kiln import native
    w = (rng.standard_normal((k, c, ks, ks)) * 0.1).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    x = rng.standard_normal((1, c, h, h)).astype(np.float32)
    sess = _session([helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[ks, ks],
                                      strides=[s, s], pads=[p] * 4),
                     helper.make_node("Relu", ["c"], ["y"])], [("x", [1, c, h, h])],
                    {"w": w, "b": b}, threads)
    want = sess.run(None, {"x": x})[0]
    wt, bt = torch.from_numpy(w), torch.from_numpy(b)
    xt = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
    xn = xt.permute(0, 2, 3, 1)
    ho = (h + 2 * p - ks) // s + 1
    y = torch.empty((1, ho, ho, k))
    if ks == 1 and p == 0:
        gemm = native.gemm_fn(native.PackedWeight(wt.reshape(k, c).t()), bt, "Relu")

        def kiln():
            xs = xn if s == 1 else xn[:, ::s, ::s].contiguous()
            gemm(xs.reshape(-1, c), None, y.view(-1, k))
    elif ks == 3 and s == 1 and c % 8 == 0 and k % 8 == 0:
        wino = native.conv3x3_fn(native.WinogradWeight(wt), bt, "Relu")

        def kiln():
            wino(xn, (p, p), None, y)
    else:
        conv = native.conv_fn(native.ConvWeight(wt), (s, s), (1, 1), bt, "Relu")

        def kiln():
            conv(xn, (p, p), None, y)
    wcl = wt.contiguous(memory_format=torch.channels_last)
    fns = {"ort": lambda: sess.run(None, {"x": x}), "kiln": kiln,
           "onednn": lambda: torch.relu_(torch.nn.functional.conv2d(xt, wcl, bt, s, p))}
    kiln()
    err = float(np.abs(y.permute(0, 3, 1, 2).numpy() - want).max() / np.abs(want).max())
    return f"conv C{c} K{k} {h}x{h} {ks}x{ks} s{s}", _time(fns), err


def gemm_case(m, k, n, threads, rng):
    import torch
    from onnx import helper

    from kiln import native
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    sess = _session([helper.make_node("MatMul", ["x", "w"], ["c"]),
                     helper.make_node("Add", ["c", "b"], ["y"])], [("x", [m, k])],
                    {"w": w, "b": b}, threads)
    want = sess.run(None, {"x": x})[0]
    gemm = native.gemm_fn(native.PackedWeight(torch.from_numpy(w)), torch.from_numpy(b))
    xt, y = torch.from_numpy(x), torch.empty(m, n)
    wt, bt = torch.from_numpy(w).t().contiguous(), torch.from_numpy(b)
    fns = {"ort": lambda: sess.run(None, {"x": x}), "kiln": lambda: gemm(xt, None, y),
           "onednn": lambda: torch.nn.functional.linear(xt, wt, bt)}
    gemm(xt, None, y)
    err = float(np.abs(y.numpy() - want).max() / np.abs(want).max())
    return f"gemm {m} x {k} x {n}", _time(fns), err


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_shapes", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--only", choices=("conv", "gemm"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    import kiln  # noqa: F401  (before torch's first parallel region: OpenMP's wait policy)
    from kiln import native
    if not native.available:
        raise SystemExit(f"kiln.native is not built: {native.why_not}")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{'shape':32s} {'ort us':>8s} {'kiln us':>8s} {'onednn':>8s} {'kiln/ort':>8s}  err")
    cases = [] if args.only == "gemm" else [lambda c=c: conv_case(*c, args.threads, rng)
                                            for c in CONVS]
    cases += [] if args.only == "conv" else [lambda c=c: gemm_case(*c, args.threads, rng)
                                             for c in GEMMS]
    for case in cases:
        name, t, err = case()
        print(f"{name:32s} {t['ort'] * 1e6:8.0f} {t['kiln'] * 1e6:8.0f} "
              f"{t['onednn'] * 1e6:8.0f} {t['kiln'] / t['ort']:8.2f}  {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
