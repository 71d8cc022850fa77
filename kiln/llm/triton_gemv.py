"""A Triton split-K GEMV for decode at batch 1: ``y[1, N] = x[1, K] @ W[N, K]^T``.

    grid (N / BLOCK_N, SPLIT): each program streams BLOCK_N rows of W over its K / SPLIT slice,
    multiplies by x, reduces in float32; SPLIT > 1 writes partial sums that one ``sum`` adds up.

Batch-1 decode is a stream of the weights, so the kernel's only job is to keep enough bytes in
flight; cuBLAS does that well for some shapes and not others. ``pick`` times cuBLAS and each
config in ``CONFIGS`` for one weight shape on the GPU and keeps the fastest (at load, once per
shape). Tested under ``TRITON_INTERPRET=1`` on small shapes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

log = logging.getLogger("kiln.llm")

# (BLOCK_N, BLOCK_K, SPLIT): few rows with long K slices, or more rows and a K split
CONFIGS = ((8, 512, 1), (16, 256, 1), (4, 1024, 1), (16, 512, 2), (32, 256, 4))


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, k_per, stride_wn, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rows = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k0 = ps * k_per
    k1 = tl.minimum(k0 + k_per, K)
    for k in range(k0, k1, BLOCK_K):
        cols = k + kk
        cmask = cols < k1
        x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    out = tl.sum(acc, 1)
    if SPLIT == 1:
        tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(y_ptr + ps * N + rows, out, mask=rmask)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config=CONFIGS[0]) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for x of one row ([1, K] or [K]); w [N, K] contiguous."""
    n, k = w.shape
    bn, bk, split = config
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    k_per = -(-k // split)
    k_per = -(-k_per // bk) * bk  # whole BLOCK_K steps per split
    split = -(-k // k_per)
    if split == 1:
        y = torch.empty(n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, n, dtype=torch.float32, device=x.device)
    _gemv[(triton.cdiv(n, bn), split)](x1, w, y, n, k, k_per, w.stride(0), BLOCK_N=bn,
                                       BLOCK_K=bk, SPLIT=split)
    if split > 1:
        y = y.sum(0).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n)


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def pick(w: torch.Tensor, name: str = "") -> tuple | None:
    """The fastest Triton config for one row against ``w`` on the GPU, or None where cuBLAS
    (``F.linear``) is as fast or a config fails to compile or launch (logged)."""
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    times = {"cublas": _time(lambda: F.linear(x, w))}
    want = F.linear(x, w).float()
    for cfg in CONFIGS:
        try:
            got = gemv(x, w, config=cfg).float()
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            if err > 1e-2:
                log.warning("triton gemv %s %s: rel err %.2g against cuBLAS, not used",
                            name, cfg, err)
                continue
            times[cfg] = _time(lambda c=cfg: gemv(x, w, config=c))
        except Exception as e:  # a config that does not build is skipped, not fatal
            log.warning("triton gemv %s %s failed (%s: %s); skipped", name, cfg,
                        type(e).__name__, str(e)[:200])
    best = min(times, key=times.get)
    log.info("gemv %s %s: %s (%s)", name, tuple(w.shape), best,
             ", ".join(f"{k}={v * 1e3:.1f}us" for k, v in times.items()))
    return None if best == "cublas" else best
