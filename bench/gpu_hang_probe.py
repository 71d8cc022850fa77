"""Where the GPU test that stopped answering on the H200 (2026-12-04, session 11) stops.

``tests/kernels/test_triton_gemm.py::test_triton_fused_matmul_layernorm[True-tactic2-]`` ran
kiln's Triton GEMM (a 16x16x16 tile, one warp, one stage) with a residual in its epilogue, then
the LayerNorm in place, on a [10, 40] x [40, 24] product, and never finished; ``timeout 70`` did
not end it either (a process stuck in the driver, or a compiler subprocess holding the pipe). The
same tile without the residual had passed just before. This script runs that call again one step
at a time, printing each step before and after it, with faulthandler dumping every thread's
Python stack every ``--dump-s`` seconds, so the log says which step stops:

  1. compile the GEMM kernel (Triton's ``warmup``: compile only, no launch)
  2. launch it, 3. synchronize, 4. the norm in place, 5. synchronize
  6. the same product through the fused op as it runs now (the norm adds the residual)

for the case without a residual first (passed before), then with one. Run it under
``timeout --kill-after`` (bench/gpu_cuda_kernels.sh does). ``python -m bench.gpu_hang_probe``.
Under TRITON_INTERPRET=1 (no GPU) the compile step is skipped and the rest runs on the CPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

import torch

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.2f} s] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def probe(with_res: bool, dev: str, interpret: bool) -> None:
    from kiln.kernels.registry import Call
    from kiln.kernels.triton import gemm as G
    from kiln.kernels.triton.common import ACT_CODE
    from kiln.kernels.triton.norm import norm_rows
    from kiln.ops import fused_conv as FC

    g = torch.Generator().manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dev, torch.float16)

    x, w, b, r = rnd(10, 40), rnd(40, 24), rnd(24), rnd(10, 24)
    scale, ln_b = rnd(24), rnd(24)
    res = r if with_res else None
    tag = "with residual" if with_res else "no residual"
    t = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "SPLIT_K": 1,
         "num_warps": 1, "num_stages": 1}
    c = torch.empty((10, 24), dtype=torch.float16, device=dev)
    args = (x, w, c, b, c if res is None else res, c, 10, 24, 40, x.stride(0), x.stride(1),
            w.stride(0), w.stride(1), c.stride(0), c.stride(1),
            *(res.stride() if res is not None else (0, 0)), 1.0, 0.0, 0.0)
    consts = dict(HAS_BIAS=True, HAS_RES=with_res, ACT=ACT_CODE[""], BLOCK_M=16, BLOCK_N=16,
                  BLOCK_K=16, GROUP_M=2, SPLIT_K=1, num_warps=1, num_stages=1)
    grid = (2, 1)
    kernel = G._gemm_kernel  # rebound to Triton's function once materialized
    kernel = kernel.materialize() if hasattr(kernel, "materialize") else kernel
    if not interpret:
        say(f"{tag}: 1. compile (warmup)")
        kernel.warmup(*args, grid=grid, **consts)
        say(f"{tag}: 1. compiled")
    say(f"{tag}: 2. launch")
    kernel[grid](*args, **consts)
    say(f"{tag}: 3. synchronize")
    sync()
    say(f"{tag}: 4. norm in place")
    norm_rows(c, scale, ln_b, 24, 1e-5, False, 32, 1, out=c)
    say(f"{tag}: 5. synchronize")
    sync()
    pre = x.float() @ w.float() + b.float() + (0 if res is None else res.float())
    want = torch.nn.functional.layer_norm(pre, (24,), scale.float(), ln_b.float(), 1e-5)
    say(f"{tag}: max |diff| {float((c.float() - want).abs().max()):.4f}")
    say(f"{tag}: 6. the fused op as it runs now")
    n = Call(FC.FusedMatMulLayerNorm.make_attrs(has_residual=int(with_res), epsilon=1e-5), 1,
             4, tactic=dict(t, LN_WARPS=1))
    y = G.fused_matmul_layernorm(n, x, w, b, res, scale, ln_b)
    sync()
    say(f"{tag}: 6. max |diff| {float((y.float() - want).abs().max()):.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dump-s", type=float, default=15.0)
    a = p.parse_args(argv)
    faulthandler.dump_traceback_later(a.dump_s, repeat=True, file=sys.stdout)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if interpret or not torch.cuda.is_available() else "cuda"
    if dev == "cpu" and not interpret:
        print("no GPU: run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    say(f"device {dev}")
    for with_res in (False, True):
        probe(with_res, dev, interpret)
    say("done")
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
