"""One convolution (+ Relu) of a given shape, kiln against onnxruntime, in one process.

    python -m bench.conv_shapes [CxHxW:KxRxSsT ...] [--threads 2] [--runs 20] [--repeats 3]

A shape ``96x52x52:96x3x3s1`` is a batch-1 input of 96 channels at 52 x 52 and 96 output
channels by a 3 x 3 window at stride 1 ("same" padding: R // 2). Each becomes a two-node ONNX
model (Conv with a bias, Relu: kiln fuses them into one FusedConv layer) built by kiln for the
CPU (its tactic timed as at any build) and run by onnxruntime; prints both medians, the tactic
kiln chose and the kiln/onnxruntime ratio over ``repeats`` interleaved rounds (lowest-highest).
kiln's time is its engine's run: the input's and output's NCHW <-> NHWC layout changes and one
layer's dispatch are in it (tens of microseconds at these sizes), not so for a conv inside a
model: a small layer's ratio here is an upper bound. The defaults are the conv classes behind
onnxruntime in the corpus's CNNs (ddddocr_det, tv_resnet50_op17) at the time of writing.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.corpus.measure import median_s

DEFAULT = ("96x52x52:96x3x3s1", "48x104x104:96x3x3s2", "12x208x208:24x3x3s1",
           "24x208x208:48x3x3s2", "192x26x26:192x1x1s1", "256x56x56:512x1x1s2",
           "128x28x28:128x3x3s1", "64x56x56:64x3x3s1", "256x14x14:256x3x3s1")


def conv_model(c: int, h: int, w: int, k: int, r: int, s: int, stride: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((k, c, r, s)) / np.sqrt(c * r * s)).astype(np.float32)
    bias = rng.standard_normal(k).astype(np.float32)
    oh, ow = (h + 2 * (r // 2) - r) // stride + 1, (w + 2 * (s // 2) - s) // stride + 1
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[r, s],
                            strides=[stride, stride], pads=[r // 2, s // 2, r // 2, s // 2])
    g = helper.make_graph(
        [conv, helper.make_node("Relu", ["c"], ["y"])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, k, oh, ow])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=list(DEFAULT), help="CxHxW:KxRxSsT")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    # kiln before torch: kiln sets OpenMP's wait policy, which torch's import fixes
    import kiln  # noqa: I001
    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    worst = 0.0
    for shape in args.shapes:
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+):(\d+)x(\d+)x(\d+)s(\d+)", shape)
        if not m:
            raise SystemExit(f"{shape}: expected CxHxW:KxRxSsT, e.g. 96x52x52:96x3x3s1")
        c, h, w, k, r, s, stride = (int(v) for v in m.groups())
        model = conv_model(c, h, w, k, r, s, stride)
        x = np.random.default_rng(1).standard_normal((1, c, h, w)).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "conv.onnx"
            onnx.save(model, path)
            engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path))
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        ctx = engine.create_context()
        want = sess.run(None, {"x": x})[0]
        got = ctx.run({"x": x})["y"]
        got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
        err = float(np.abs(got - want).max() / max(1e-30, float(np.abs(want).max())))
        worst = max(worst, err)
        ratios, tk, to = [], 0.0, 0.0
        for _ in range(args.repeats):
            tk = median_s(lambda cx=ctx, a=x: cx.run({"x": a}), args.runs, warmup=3)
            to = median_s(lambda se=sess, a=x: se.run(None, {"x": a}), args.runs, warmup=3)
            ratios.append(tk / to)
        tactics = sorted({str(t) for t in getattr(engine, "tactics", {}).values()}) \
            if isinstance(getattr(engine, "tactics", None), dict) else []
        print(f"{shape}: kiln {1e3 * tk:.3f} ms, onnxruntime {1e3 * to:.3f} ms, kiln/ort "
              f"{min(ratios):.2f}-{max(ratios):.2f}, max rel err {err:.1e}"
              + (f", tactic {','.join(tactics)}" if tactics else ""), flush=True)
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
