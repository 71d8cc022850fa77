"""Depthwise convs on CUDA (issue #6): kiln's Triton depthwise tactic against cuDNN, per layer.

    PYTHONPATH=. python bench/depthwise_check.py [--batches 1,64] [--reps 50]

The layers are MobileNetV2's and EfficientNet's depthwise 3x3 / 5x5 shapes, FP16, channels-last
(the CUDA FusedConv's layout), with bias and ReLU6 (Clip 0..6) fused. For each layer and batch:
every tactic of ``kiln.kernels.triton.depthwise`` is checked against ``F.conv2d`` (max|d| /
max|ref| <= 1e-2) and timed; cuDNN is ``F.conv2d`` + the bias add and the clamp in torch (what
the layer costs without kiln's kernel), timed the same way (CUDA graph of ``--reps`` calls, median
of 5 replays, per call). Prints one line per layer: the best tactic, its time, cuDNN's time and
cuDNN / kiln (> 1: kiln is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from kiln.kernels.triton import depthwise

# (channels, H=W, kernel, stride): MobileNetV2 at 224 and a few EfficientNet-B0 5x5 layers
LAYERS = [(32, 112, 3, 1), (96, 112, 3, 2), (144, 56, 3, 1), (144, 56, 3, 2), (192, 28, 3, 1),
          (384, 14, 3, 1), (576, 14, 3, 2), (960, 7, 3, 1), (240, 28, 5, 1), (672, 14, 5, 2)]


def timed(fn, reps: int) -> float:
    """Milliseconds per call: a CUDA graph of ``reps`` calls, the median of 5 replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def check_layer(nb: int, c: int, hw: int, k: int, s: int, reps: int) -> tuple[str, int]:
    """(the report line for one layer and batch, the number of tactics that failed the check)."""
    dev, dt = "cuda", torch.float16
    x = torch.randn(nb, c, hw, hw, device=dev, dtype=dt).to(memory_format=torch.channels_last)
    w = torch.randn(c, 1, k, k, device=dev, dtype=dt) * 0.2
    bias = torch.randn(c, device=dev, dtype=dt)
    pad = k // 2
    oh = (hw + 2 * pad - k) // s + 1
    geo = ((pad, pad), (s, s), (1, 1), (oh, oh))
    wl = w.to(memory_format=torch.channels_last)

    def cudnn():
        return F.conv2d(x, wl, bias, s, pad, 1, c).clamp_(0.0, 6.0)

    ref = cudnn().float()
    best, bad, what = None, 0, f"b{nb} c{c} {hw}x{hw} k{k} s{s}"
    for t in depthwise.tactics(c, nb * oh * oh):
        def ours(t=t):
            return depthwise.conv2d(t, x, w, bias, None, geo, "Clip", 0.0, 6.0)
        err = float((ours().float() - ref).abs().max() / ref.abs().max())
        if not err <= 1e-2:
            print(f"MISMATCH {what} {t}: {err:.2e}")
            bad += 1
            continue
        ms = timed(ours, reps)
        if best is None or ms < best[0]:
            best = (ms, t, err)
    ms_cudnn = timed(cudnn, reps)
    if best is None:
        return f"{what}: every tactic failed the check", bad
    ms, t, err = best
    tile = f"{t['BLOCK_P']}x{t['BLOCK_C']} w{t['num_warps']}"
    return (f"{what}: kiln {ms * 1e3:7.1f} us ({tile}, err {err:.1e})  cuDNN+epilogue "
            f"{ms_cudnn * 1e3:7.1f} us  ratio {ms_cudnn / ms:5.2f}"), bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    bad = 0
    for nb in (int(b) for b in args.batches.split(",")):
        for layer in LAYERS:
            line, n_bad = check_layer(nb, *layer, args.reps)
            print(line, flush=True)
            bad += n_bad
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
