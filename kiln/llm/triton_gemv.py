"""A Triton split-K GEMV for decode at small batch: ``y[M, N] = x[M, K] @ W[N, K]^T (* s[N])``.

    grid (N / BLOCK_N, SPLIT): each program streams BLOCK_N rows of W over its K / SPLIT slice,
    multiplies by the M rows of x, reduces in float32; SPLIT > 1 writes partial sums that one
    ``sum`` adds up.

Decode at small batch is a stream of the weights, so the kernel's only job is to keep enough
bytes in flight; cuBLAS does that well for some shapes and not others. W is FP16/BF16/FP32, or
FP8 e4m3 with one scale per output row (``fp8.py``): each tile is widened to float32 in
registers and the row scale applied to the sums, so FP8 weights stream half the bytes of FP16.
``pick`` times the vendor path and each config in ``CONFIGS`` for one weight shape on the GPU
(inside a CUDA graph, as decode runs) and keeps the fastest (at load, once per shape). Tested
under ``TRITON_INTERPRET=1`` on small shapes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

log = logging.getLogger("kiln.llm")

# (BLOCK_N, BLOCK_K, SPLIT[, warps]): few rows with long K slices, or more rows and a K split;
# 8 warps where the tile is big enough to give them each whole 16-byte loads
CONFIGS = ((8, 512, 1), (16, 256, 1), (4, 1024, 1), (16, 512, 2), (32, 256, 4),
           (16, 512, 1, 8), (32, 256, 1, 8))
# FP8 rows are half the bytes: longer K slices keep as many bytes in flight
FP8_CONFIGS = CONFIGS + ((8, 1024, 1), (16, 1024, 1), (4, 2048, 1), (16, 1024, 1, 8),
                         (32, 512, 1, 8))
MAX_ROWS = 8  # rows of x one launch takes (the float32 tile grows with them)


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, y_ptr, N, K, k_per, stride_xm, stride_wn, stride_ym,
          M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    rows = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, M_PAD)
    mmask = m < M
    k0 = ps * k_per
    k1 = tl.minimum(k0 + k_per, K)
    if M_PAD == 1:  # one row of x: a 2-D tile, reduced once at the end
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k in range(k0, k1, BLOCK_K):
            cols = k + kk
            cmask = cols < k1
            x = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if SILU_MUL:  # x_ptr holds [gate | up] (2K): x = silu(gate) * up, made here
                u = tl.load(x_ptr + K + cols, mask=cmask, other=0.0).to(tl.float32)
                x = x / (1.0 + tl.exp(-x)) * u
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                        mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc1 += w * x[None, :]
        out = tl.sum(acc1, 1)[None, :]  # [1, BLOCK_N]
    else:
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
        for k in range(k0, k1, BLOCK_K):
            cols = k + kk
            cmask = cols < k1
            x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :],
                        mask=mmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                        mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += w[None, :, :] * x[:, None, :]
        out = tl.sum(acc, 2)  # [M_PAD, BLOCK_N]
    if HAS_SCALE:
        out = out * tl.load(s_ptr + rows, mask=rmask, other=0.0)[None, :]
    omask = mmask[:, None] & rmask[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + m[:, None] * stride_ym + rows[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(y_ptr + ps * M * N + m[:, None] * N + rows[None, :], out, mask=omask)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config=CONFIGS[0], scale: torch.Tensor | None = None,
         silu_mul: bool = False) -> torch.Tensor:
    """``F.linear(x, w * scale[:, None], bias)`` for x of up to ``MAX_ROWS`` rows ([..., K]);
    w [N, K] contiguous (FP8 e4m3 with ``scale`` [N] float32, or x's dtype). ``silu_mul``: x is
    one row [gate | up] of 2K and the GEMV's input is silu(gate) * up, made in registers."""
    n, k = w.shape
    bn, bk, split = config[:3]
    warps = config[3] if len(config) > 3 else 4
    x2 = x.reshape(-1, 2 * k if silu_mul else k)
    rows = x2.shape[0]
    if rows > MAX_ROWS or (silu_mul and rows != 1):
        raise ValueError(f"gemv takes up to {MAX_ROWS} rows (silu_mul: one), got {rows}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m_pad = triton.next_power_of_2(rows)
    bk = max(32, bk // m_pad)  # the same float32 tile for more rows
    k_per = -(-k // split)
    k_per = -(-k_per // bk) * bk  # whole BLOCK_K steps per split
    split = -(-k // k_per)
    if split == 1:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    _gemv[(triton.cdiv(n, bn), split)](
        x2, w, w if scale is None else scale, y, n, k, k_per, x2.stride(0), w.stride(0), n,
        M=rows, M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, HAS_SCALE=scale is not None,
        SILU_MUL=silu_mul, num_warps=warps)
    if split > 1:
        y = y.sum(0).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n)


def _silu_mul_ref(gu):
    g, u = gu.float().chunk(2, dim=-1)
    return F.silu(g) * u


def _time(fn, copies: int, reps: int = 20) -> float:
    """ms per call of ``fn(i)`` (i the weight copy to read, round robin), from a CUDA graph of
    ``reps`` calls, as decode replays them (no launch cost); eager where capture fails."""
    fn(0)
    torch.cuda.synchronize()
    run = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i % copies)
        run = graph.replay
    except Exception:  # timing only: eager calls measure the same kernels, plus launches
        torch.cuda.synchronize()

        def run():
            for i in range(reps):
                fn(i % copies)
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


L2_BYTES = 64 << 20  # past the H200's 50 MB L2: each timed call streams its weight from HBM


def pick(w: torch.Tensor, name: str = "", scale: torch.Tensor | None = None,
         vendor=None, x_dtype=None, silu_mul: bool = False):
    """The fastest Triton config for one row against ``w`` on the GPU, or None where the vendor
    path (``vendor(x, w, scale)``; default ``F.linear``) is as fast or a config fails to
    compile or launch (logged). ``scale``: FP8 ``w``'s per-row scales; ``x_dtype``: the
    activations' (default w's).

    ``silu_mul``: w's input is silu(gate) * up of a [gate | up] row. Every path then includes
    the separate activation kernel (``triton_fused.silu_mul``), one-pass configs that make the
    activation in registers instead compete too, and the answer is a pair: (the best config
    with the separate kernel or None, the fused config if it beats that, else None)."""
    vendor = vendor or (lambda x, w_, s_: F.linear(x, w_))
    k = w.shape[1]
    x = torch.randn(1, 2 * k if silu_mul else k, dtype=x_dtype or w.dtype, device=w.device)
    if silu_mul:
        from kiln.llm.triton_fused import silu_mul as act
    else:
        def act(x_):
            return x_
    nbytes = w.numel() * w.element_size()
    copies = max(1, min(8, -(-2 * L2_BYTES // nbytes)))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    times = {"vendor": _time(lambda i: vendor(act(x), ws[i], scale), copies)}
    wf = w.float() if scale is None else w.float() * scale[:, None]
    want = F.linear(_silu_mul_ref(x) if silu_mul else x.float(), wf)
    configs = [(c, False) for c in (CONFIGS if scale is None else FP8_CONFIGS)]
    configs += [(c, True) for c, _ in configs if silu_mul and c[2] == 1]
    for cfg, fused in configs:
        key = ("silu_mul", cfg) if fused else cfg
        try:
            got = gemv(x if fused else act(x), w, config=cfg, scale=scale, silu_mul=fused)
            err = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            if err > 1e-2:
                log.warning("triton gemv %s %s: rel err %.2g against float32, not used",
                            name, key, err)
                continue
            times[key] = _time(lambda i, c=cfg, f=fused: gemv(
                x if f else act(x), ws[i], config=c, scale=scale, silu_mul=f), copies)
        except Exception as e:  # a config that does not build is skipped, not fatal
            log.warning("triton gemv %s %s failed (%s: %s); skipped", name, key,
                        type(e).__name__, str(e)[:200])
    log.info("gemv %s %s %s: %s", name, tuple(w.shape), w.dtype,
             ", ".join(f"{k}={v * 1e3:.1f}us" for k, v in times.items()))
    plain = {k: v for k, v in times.items() if not (isinstance(k, tuple) and k[0] == "silu_mul")}
    best = min(plain, key=plain.get)
    best_cfg = None if best == "vendor" else best
    if not silu_mul:
        return best_cfg
    fused = {k[1]: v for k, v in times.items() if k not in plain}
    f_best = min(fused, key=fused.get, default=None)
    return best_cfg, (f_best if f_best is not None and fused[f_best] < plain[best] else None)
