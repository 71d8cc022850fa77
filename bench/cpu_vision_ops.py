"""``python -m bench.cpu_vision_ops [--threads T] [--rounds N]``: kiln's CPU kernels for the
segmentation and detector rows of the corpus against the torch kernels they replace, in one
process, interleaved (ABBA) and checked to agree: the bilinear upsample of LR-ASPP's and
DeepLabV3's heads (resize.c against ``F.interpolate``), a detector's class-score softmax
(softmax.c against ``torch.softmax``) and the backbones' dilation-2 depthwise convs (kiln's
depthwise, NHWC, against ``F.conv2d`` on a channels-last tensor, oneDNN). Medians in us."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.native_ab import _median_pair
from kiln import native

RESIZES = [(21, 40, 320, True), (21, 40, 320, False), (21, 16, 256, True), (256, 1, 16, True)]
SOFTMAXES = [(3234, 21), (3234, 91), (12 * 128, 128)]
DILATED = [(960, 20, 5, 2), (672, 20, 5, 2), (960, 16, 5, 2), (480, 40, 3, 2)]  # C, H=W, k, d


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, {args.rounds} interleaved rounds, medians in us "
          "(torch, kiln, torch / kiln)")
    for c, h, o, cl in RESIZES:
        x = torch.randn(1, c, h, h)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(native.resize_linear2d(x, (o, o), False),
                                   F.interpolate(x, (o, o), mode="bilinear"), rtol=1e-6,
                                   atol=2e-6)
        a, b = _median_pair(lambda x=x, o=o: F.interpolate(x, (o, o), mode="bilinear"),
                            lambda x=x, o=o: native.resize_linear2d(x, (o, o), False),
                            args.rounds)
        print(f"resize bilinear 1x{c}x{h}x{h} -> {o}x{o} {'NHWC' if cl else 'NCHW'}: "
              f"{a:.1f} {b:.1f} ({a / b:.2f}x)")
    for rows, n in SOFTMAXES:
        x = torch.randn(rows, n) * 3
        torch.testing.assert_close(native.softmax_rows(x), torch.softmax(x, -1), rtol=2e-6,
                                   atol=1e-7)
        a, b = _median_pair(lambda x=x: torch.softmax(x, -1), lambda x=x: native.softmax_rows(x),
                            args.rounds)
        print(f"softmax [{rows}, {n}]: {a:.1f} {b:.1f} ({a / b:.2f}x)")
    for c, h, k, d in DILATED:
        p = d * (k - 1) // 2
        w, bias = torch.randn(c, 1, k, k), torch.randn(c)
        x = torch.randn(1, c, h, h).contiguous(memory_format=torch.channels_last)
        run = native.depthwise_fn(native.DepthwiseWeight(w), (1, 1), (d, d), bias, "HardSwish")
        nhwc, out = x.permute(0, 2, 3, 1), torch.empty(1, h, h, c)

        def ref(x=x, w=w, bias=bias, p=p, d=d, c=c):
            return F.hardswish(F.conv2d(x, w, bias, 1, p, d, c))

        def kiln(run=run, nhwc=nhwc, p=p, out=out):
            return run(nhwc, (p, p), None, out)
        torch.testing.assert_close(kiln().permute(0, 3, 1, 2), ref(), rtol=1e-4, atol=1e-4)
        a, b = _median_pair(ref, kiln, args.rounds)
        print(f"depthwise {c}x{h}x{h} {k}x{k} dilation {d} +HardSwish: {a:.1f} {b:.1f} "
              f"({a / b:.2f}x)")


if __name__ == "__main__":
    main()
