"""python -m bench.native_ab --base PATH/_kernels.so: kiln's CPU kernels A/B in one process.

On a machine shared with other work, whole-model timings swing 2-3x from run to run; the fair
comparison of a kernel change is the old library and the new one loaded side by side, called
alternately on the same inputs. This loads ``--base`` (another checkout's built
``kiln/native/_kernels*.so``) next to this tree's, checks that both give the same result
(within 1e-5), and prints each shape's median of ``--rounds`` interleaved timings, base and
new: the 3-channel NCHW -> NHWC input copy (pointwise), narrow-K 1x1-conv GEMMs, the
3-channel 3x3 stride-2 stems (direct conv) and mobile-CNN depthwise convs. Both libraries
must share the kernels' C signatures and weight packings (true of every commit since the ISA
switch, kiln_conv_set_isa, which only this tree's library needs)."""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from kiln import native

_L, _P, _I, _F = ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

DEPTHWISE = [(116, 28, 3, 1, "Relu"), (232, 14, 3, 1, ""), (232, 14, 3, 2, ""),
             (464, 7, 3, 1, ""), (96, 112, 3, 2, "Silu"), (240, 28, 5, 2, "Silu"),
             (672, 14, 5, 1, "HardSwish"), (32, 112, 3, 1, "Silu"), (58, 28, 3, 2, ""),
             (144, 56, 3, 1, "Clip")]  # C, H = W, k, stride, activation
STEMS = [(16, "HardSwish"), (24, "Relu"), (32, "Silu")]  # 3 -> K, 3x3 s2 at 224
GEMMS = [(12544, 16, 64, "Relu"), (3136, 24, 72, "Relu"), (784, 40, 120, ""),
         (12544, 32, 16, ""), (12544, 16, 32, "HardSwish"), (3136, 24, 40, "Relu"),
         (3136, 32, 128, "")]  # M, K, N, activation


def _bind(lib):
    lib.kiln_depthwise.argtypes = [_P, _P, _P, _P, _P, _P, _I, _F, _F, _I]
    lib.kiln_conv.argtypes = [_P, _P, _P, _P, _P, _P, _I, _F, _F, _I]
    lib.kiln_conv.restype = _I
    lib.kiln_sgemm.argtypes = [_L, _L, _L, _P, _L, _P, _P, _P, _L, _P, _L, _I, _F, _F, _I]
    lib.kiln_pointwise.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _P, _F, _F, _I]
    return lib


def _median_pair(fa, fb, rounds: int, target_s: float = 0.02) -> tuple[float, float]:
    fa(), fb()
    t = time.perf_counter()
    fb()
    n = max(5, int(target_s / max(time.perf_counter() - t, 1e-7)))
    ta, tb = [], []
    for i in range(rounds):  # ABBA: neither library always runs first
        for f, acc in ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta)):
            t = time.perf_counter()
            for _ in range(n):
                f()
            acc.append((time.perf_counter() - t) / n * 1e6)
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]


def _check(a, b, what):
    if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
        raise SystemExit(f"{what}: base and new differ by {float((a - b).abs().max()):.3g}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the base checkout's _kernels*.so")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--isa", choices=["avx2", "avx512"], default=None,
                    help="this tree's float kernels' instruction set (default: the best)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.isa:
        native.set_conv_isa(args.isa)
    base, new, nt = _bind(ctypes.CDLL(args.base)), native._lib, args.threads
    acts = native.ACTIVATIONS
    print(f"threads {nt}, this tree's ISA {args.isa or native.conv_isas()[-1]}, "
          f"{args.rounds} interleaved rounds, medians in us")

    x = torch.randn(1, 3, 224, 224)
    shape, sa = (_L * 4)(1, 3, 224, 224), (_L * 4)(*x.stride())
    ya, yb = (torch.empty(1, 224, 224, 3).permute(0, 3, 1, 2) for _ in range(2))
    sy = (_L * 4)(*ya.stride())

    def copy(lib, y):
        return lambda: lib.kiln_pointwise(0, 4, shape, y.data_ptr(), sy, x.data_ptr(), sa, None,
                                          None, 0.0, 0.0, nt)
    copy(base, ya)(), copy(new, yb)()
    _check(ya, yb, "copy")
    a, b = _median_pair(copy(base, ya), copy(new, yb), args.rounds)
    print(f"copy 1x3x224x224 NCHW -> NHWC: base {a:.1f}, new {b:.1f} ({a / b:.2f}x)")

    for m, k, n, act in GEMMS:
        xa, w, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
        pw = native.PackedWeight(w)
        ca, cb = torch.empty(m, n), torch.empty(m, n)

        def gemm(lib, c, xa=xa, pw=pw, bias=bias, m=m, k=k, n=n, act=act):
            return lambda: lib.kiln_sgemm(m, n, k, xa.data_ptr(), k, pw.data.data_ptr(),
                                          bias.data_ptr(), None, 0, c.data_ptr(), n, acts[act],
                                          float("-inf"), float("inf"), nt)
        gemm(base, ca)(), gemm(new, cb)()
        _check(ca, cb, "gemm")
        a, b = _median_pair(gemm(base, ca), gemm(new, cb), args.rounds)
        print(f"gemm {m}x{k}x{n} +bias {act or '-'}: base {a:.1f}, new {b:.1f} ({a / b:.2f}x)")

    for k, act in STEMS:
        xs = torch.randn(1, 224, 224, 3)
        cw = native.ConvWeight(torch.randn(k, 3, 3, 3))
        bias = torch.randn(k)
        g = (_L * 15)(1, 224, 224, 3, k, 112, 112, 3, 3, 2, 2, 1, 1, 1, 1)
        oa, ob = torch.empty(1, 112, 112, k), torch.empty(1, 112, 112, k)

        def stem(lib, o, xs=xs, cw=cw, bias=bias, g=g, act=act):
            return lambda: lib.kiln_conv(g, xs.data_ptr(), cw.data.data_ptr(), bias.data_ptr(),
                                         None, o.data_ptr(), acts[act], float("-inf"),
                                         float("inf"), nt)
        stem(base, oa)(), stem(new, ob)()
        _check(oa, ob, "stem")
        a, b = _median_pair(stem(base, oa), stem(new, ob), args.rounds)
        print(f"stem 3->{k} 3x3 s2 @224 {act}: base {a:.1f}, new {b:.1f} ({a / b:.2f}x)")

    for c, h, k, s, act in DEPTHWISE:
        p = k // 2
        ho = (h + 2 * p - k) // s + 1
        xd = torch.randn(1, h, h, c)
        dwp = native.DepthwiseWeight(torch.randn(c, 1, k, k))
        bias = torch.randn(c)
        g = (_L * 14)(1, h, h, c, ho, ho, k, k, s, s, 1, 1, p, p)
        lo, hi = (0.0, 6.0) if act == "Clip" else (float("-inf"), float("inf"))
        oa, ob = torch.empty(1, ho, ho, c), torch.empty(1, ho, ho, c)

        def dw(lib, o, xd=xd, dwp=dwp, bias=bias, g=g, act=act, lo=lo, hi=hi):
            return lambda: lib.kiln_depthwise(g, xd.data_ptr(), dwp.data.data_ptr(),
                                              bias.data_ptr(), None, o.data_ptr(), acts[act],
                                              lo, hi, nt)
        dw(base, oa)(), dw(new, ob)()
        _check(oa, ob, "depthwise")
        a, b = _median_pair(dw(base, oa), dw(new, ob), args.rounds)
        print(f"depthwise {c}x{h}x{h} {k}x{k} s{s} {act or '-'}: base {a:.1f}, new {b:.1f} "
              f"({a / b:.2f}x)")
    native.set_conv_isa(None)


if __name__ == "__main__":
    main()
