"""``python -m bench.precision --device cuda``: FP16 vs INT8 vs FP8 kiln engines on one GPU.

Self-contained (models from kiln.zoo, seeded weights, no downloads): BERT-base s128 b64 and
ResNet-50 b256, each built FP16, FP16+INT8 (entropy calibration on held-apart random batches)
and FP16+FP8 (BERT only: convolutions have no FP8 kernel), timed on device-resident inputs
(median of ``-n`` runs after warm-up), throughput ratios against FP16; accuracy on inputs held
out from calibration: mean cosine of BERT's outputs to an FP32 engine's, ResNet-50's top-1
agreement with FP32 (seeded random weights and N(0, 1) images: the agreement says how much the
ranking moves, not ImageNet accuracy).
"""

from __future__ import annotations

import time

import numpy as np
import torch


def _build(path, profile, **cfg):
    from kiln.builder import Builder, BuilderConfig

    b = Builder(BuilderConfig(device="cuda", profiles=[profile], check_finite=False, **cfg))
    e = b.build(str(path))
    return e, b.report


def _timed(engine, feeds, n):
    ctx = engine.create_context()
    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    for _ in range(3):
        ctx.run(dev, copy_outputs=False)
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        ctx.run(dev, copy_outputs=False)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def _outputs(engine, batches):
    ctx = engine.create_context()
    return [np.asarray(next(iter(ctx.run(b).values())), np.float32) for b in batches]


def _cos(a, b):
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    return float(np.mean((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))


def _model_rows(name, path, inputs, batch, calib, held, metric, precisions, n):
    from kiln.engine.profile import Profile

    feeds = inputs(batch)
    prof = Profile.fixed({k: v.shape for k, v in feeds.items()})
    ref = _outputs(_build(path, prof)[0], held)
    rows, base = [], None
    for label, cfg in precisions:
        try:
            e, rep = _build(path, prof, calib=calib, **cfg)
            ms = _timed(e, feeds, n)
            acc = metric(_outputs(e, held), ref)
        except Exception as ex:  # one precision failing must not hide the others
            rows.append((name, label, f"failed: {type(ex).__name__}: {str(ex)[:120]}"))
            continue
        base = base or ms
        quant = len(rep.get("int8", {}).get("int8", []))
        rows.append((name, label, f"{ms:8.2f} ms  {1e3 * batch / ms:9.1f}/s  "
                                  f"{base / ms:5.2f}x FP16  {quant:3d} quantized  {acc}"))
        print("  ".join(rows[-1][:2]) + "  " + rows[-1][2], flush=True)
    return rows


def run_cuda(args) -> int:
    from kiln.zoo import bert, build_onnx, resnet

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    rng = np.random.default_rng(0)
    n = max(args.n, 20)
    precisions = [("FP16", dict(fp16=True)), ("INT8", dict(fp16=True, int8=True)),
                  ("FP8", dict(fp16=True, fp8=True))]
    print(f"device: {torch.cuda.get_device_name()}")

    def bert_in(b):
        return bert.sample_inputs(b, 128, rng)

    def cos_metric(got, ref):
        return f"cosine to FP32 {np.mean([_cos(g, r) for g, r in zip(got, ref)]):.5f}"

    models = set(getattr(args, "cuda_models", "bert,resnet50").split(","))
    rows = []
    if "bert" in models:
        rows += _model_rows("BERT-base s128", build_onnx("bert-base"), bert_in, 64,
                            [bert_in(16) for _ in range(4)], [bert_in(64) for _ in range(2)],
                            cos_metric, precisions, n)

    def img(b):
        return resnet.sample_inputs(b, 0, rng)

    def top1(got, ref):
        agree = np.mean([np.mean(g.argmax(1) == r.argmax(1)) for g, r in zip(got, ref)])
        return f"top-1 agreement with FP32 {100 * agree:.2f}%"

    if "resnet50" in models:
        rows += _model_rows("ResNet-50", build_onnx("resnet50"), img, 256,
                            [img(32) for _ in range(4)], [img(256) for _ in range(2)], top1,
                            precisions[:2], n)
    print("\n| model | precision | result |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2].strip()} |")
    return 0
