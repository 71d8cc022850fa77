"""INT8 accuracy and latency (issue 18's measurements).

    python -m bench.precision                 # CPU: MiniLM accuracy + latency ratios
    python -m bench.precision --device cuda   # H200: BERT-base / ResNet-50 FP16 vs INT8 vs FP8

CPU, in one process on the same inputs:

1. all-MiniLM-L6-v2 (real weights): INT8 engines calibrated on 96 real sentences
   (:mod:`bench.sentences`), mean cosine of mean-pooled embeddings to the FP32 engine's on 256
   held-out sentences, for each calibrator; then the layers ``kiln debug precision`` keeps.
2. Latency, as ratios of medians of runs timed in alternation: kiln INT8 / kiln FP32 on
   MiniLM and BERT-base, and kiln / onnxruntime on onnxruntime's own quantized MiniLM
   (``quantize_static`` QDQ and ``quantize_dynamic`` QOperator). ``--threads`` (default 1:
   the machine these numbers came from is shared, and 2-thread runs there measure the
   scheduler) applies to all of them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.sentences import split


def _minilm_batches(texts, bs):
    from kiln.zoo import minilm

    return [minilm.minilm_tokenize(texts[i:i + bs]) for i in range(0, len(texts), bs)]


def pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    e = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def embed(engine, batches) -> np.ndarray:
    ctx = engine.create_context()
    return np.concatenate([pooled(next(iter(ctx.run(b).values())), b["attention_mask"])
                           for b in batches])


def paired_ms(fns: dict, n: int) -> dict[str, float]:
    """Median ms of each function, timed in alternation (one run of each per round), so that
    a shared machine's slow stretches fall on all of them alike."""
    for fn in fns.values():
        fn()
        fn()
    ts: dict[str, list] = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: 1e3 * float(np.median(v)) for k, v in ts.items()}


def accuracy(path: str, calib, held, tmp: Path) -> dict:
    from kiln.builder import Builder, BuilderConfig
    from kiln.compare.precision_search import search

    ref = embed(Builder(BuilderConfig()).build(path), held)
    rows = {}
    for cal, asym, smooth in (("entropy", False, 0.0), ("minmax", False, 0.0),
                              ("percentile", False, 0.0), ("entropy", True, 0.0),
                              ("minmax", True, 0.0), ("entropy", True, 0.5),
                              ("auto", True, 0.5)):
        cfg = BuilderConfig(int8=True, calib=calib, calibrator=cal, int8_asymmetric=asym,
                            int8_smoothing=smooth, check_finite=False,
                            calib_cache=str(tmp / f"{cal}{asym}{smooth}.cache"))
        cos = (embed(Builder(cfg).build(path), held) * ref).sum(1)
        label = f"{cal:<10} {'asym' if asym else 'sym ':<5} smooth {smooth:<3}"
        rows[label] = (float(cos.mean()), float(cos.min()))
        print(f"  {label}{' (default)' if cal == 'auto' else '          '} mean cosine "
              f"{cos.mean():.5f} (min {cos.min():.5f})", flush=True)
    keep, _ = search(path, calib, "cos>=0.9995", None, log=lambda m: None)  # the defaults
    cfg = BuilderConfig(int8=True, calib=calib, calib_cache=str(tmp / "autoTrue0.5.cache"),
                        check_finite=False, layer_precision={k: "fp32" for k in keep})
    cos = (embed(Builder(cfg).build(path), held) * ref).sum(1)
    rows["debug precision keeps"] = (float(cos.mean()), float(cos.min()), keep)
    print(f"  defaults + {len(keep)} layer(s) kept in FP32 by kiln debug precision: mean "
          f"cosine {cos.mean():.5f} (min {cos.min():.5f}); kept: {keep}", flush=True)
    return rows


def _kiln_fn(path, feeds, **cfg):
    from kiln.builder import Builder, BuilderConfig

    ctx = Builder(BuilderConfig(check_finite=False, **cfg)).build(str(path)).create_context()
    return lambda: ctx.run(feeds)


def _ort_fn(path, feeds, threads):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return lambda: sess.run(None, feeds)


def latency(models: dict, calib_of: dict, feeds_of: dict, tmp: Path, n: int,
            threads: int) -> None:
    for name, path in models.items():
        feeds, calib = feeds_of[name], calib_of[name]
        ms = paired_ms({"fp32": _kiln_fn(path, feeds), "int8": _kiln_fn(
            path, feeds, int8=True, calib=calib, calib_cache=str(tmp / f"{name}.lat.cache"))},
            n)
        fp32, int8 = ms["fp32"], ms["int8"]
        print(f"  {name}: kiln FP32 {fp32:.1f} ms, kiln INT8 {int8:.1f} ms: INT8 is "
              f"{fp32 / int8:.2f}x faster", flush=True)


def ort_quantized(path: str, calib, feeds, tmp: Path, n: int, threads: int) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    dyn, qdq = tmp / "minilm.dynamic.onnx", tmp / "minilm.static_qdq.onnx"
    quantize_dynamic(path, str(dyn), weight_type=QuantType.QInt8)
    quantize_static(path, str(qdq), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    per_channel=True, op_types_to_quantize=["MatMul", "Gemm"])
    for label, p in (("quantize_static (QDQ)", qdq), ("quantize_dynamic (QOperator)", dyn)):
        try:
            kiln = _kiln_fn(p, feeds)
        except Exception as e:  # report, keep measuring the rest
            print(f"  {label}: kiln failed ({type(e).__name__}: {str(e)[:200]})")
            continue
        ms = paired_ms({"kiln": kiln, "ort": _ort_fn(p, feeds, threads)}, n)
        k, o = ms["kiln"], ms["ort"]
        print(f"  {label}: kiln {k:.1f} ms, onnxruntime {o:.1f} ms: kiln/onnxruntime "
              f"{k / o:.2f}x", flush=True)


def cpu(args) -> None:
    from kiln.zoo import bert, build_onnx, minilm

    torch.set_num_threads(args.threads)
    calib_s, held_s = split(96, 256)
    calib, held = _minilm_batches(calib_s, 16), _minilm_batches(held_s, 32)
    path = str(build_onnx("minilm"))
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if "accuracy" in args.parts:
            print(f"MiniLM INT8 accuracy (96 calibration, {len(held_s)} held-out sentences):")
            accuracy(path, calib, held, tmp)
        rng = np.random.default_rng(0)
        feeds = {"minilm": minilm.sample_inputs(args.batch, 128, rng)}
        models = {"minilm": path}
        calibs = {"minilm": calib}
        if "bert" in args.parts:
            models["bert-base"] = str(build_onnx("bert-base"))
            feeds["bert-base"] = bert.sample_inputs(args.batch, 128, rng)
            calibs["bert-base"] = [bert.sample_inputs(8, 128, rng) for _ in range(4)]
        if "latency" in args.parts:
            print(f"latency, b{args.batch} s128, {args.threads} thread(s), median of {args.n}:")
            latency(models, calibs, feeds, tmp, args.n, args.threads)
        if "ort" in args.parts:
            print("onnxruntime-quantized MiniLM, kiln vs onnxruntime:")
            ort_quantized(path, calib, feeds["minilm"], tmp, args.n, args.threads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("-n", type=int, default=10, help="timed runs per measurement")
    p.add_argument("--parts", default="accuracy,latency,ort,bert",
                   help="CPU parts to run: accuracy, latency, ort, bert (comma-separated)")
    p.add_argument("--cuda-models", default="bert,resnet50",
                   help="CUDA: which models to run (bert, resnet50; comma-separated)")
    args = p.parse_args(argv)
    args.parts = set(args.parts.split(","))
    if args.device == "cuda":
        from bench.precision_cuda import run_cuda

        return run_cuda(args)
    cpu(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
