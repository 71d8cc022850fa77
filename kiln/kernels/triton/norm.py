"""Triton LayerNormalization and RMSNormalization: one row per program, fp32 statistics.

The normalized dims (``axis`` to the end) are flattened into one row of N elements. When one
BLOCK covers the row it stays in registers (one read, one write); otherwise the kernel loops over
the row in BLOCK chunks (three reads). Tactic: ``{"BLOCK", "num_warps"}``, and for short rows
``{"BLOCK", "num_warps", "ROWS"}``: ROWS whole rows a program.
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch import int8 as torch_int8
from kiln.kernels.torch import nn_norm as torch_norm
from kiln.kernels.triton.common import (
    FLOATS,
    INTERPRET,
    launch,
    next_pow2,
    on_device,
    quantize8,
    tactic_of,
    warps_for,
)
from kiln.kernels.triton.lazy import cdiv, jit, tl
from kiln.ops import int8 as I8
from kiln.ops import nn as N
from kiln.ops.rules import norm_axis


@jit
def _row(x_row, r_row, c, m, HAS_R: tl.constexpr):
    """A chunk of the normalized row in fp32: x, plus the residual where there is one."""
    x = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
    if HAS_R:
        x += tl.load(r_row + c, mask=m, other=0.0).to(tl.float32)
    return x


@jit
def _store(y_row, q_row, QM, c, m, y, zshift, QUANT: tl.constexpr, FP8: tl.constexpr,
           EXACT: tl.constexpr):
    """A chunk of the output row, and with ``QUANT`` its codes ``y * qm`` (LayerNormQuant)."""
    tl.store(y_row + c, y.to(y_row.dtype.element_ty), mask=m)
    if QUANT:
        qm = tl.load(QM + c, mask=m, other=0.0)
        tl.store(q_row + c, quantize8(y * qm, 1.0, zshift, FP8, EXACT), mask=m)


@jit
def _norm_kernel(X, W, B, Y, R, Q, QM, stride_x, stride_y, stride_r, n_cols, eps, zshift,
                 HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr,
                 ONE_BLOCK: tl.constexpr, HAS_R: tl.constexpr = False,
                 QUANT: tl.constexpr = False, FP8: tl.constexpr = False,
                 EXACT: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row, r_row = X + row * stride_x, Y + row * stride_y, R + row * stride_r
    q_row = Q + row * stride_y
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        m = cols < n_cols
        x = _row(x_row, r_row, cols, m, HAS_R)
        if RMS:
            xc = x
        else:
            xc = tl.where(m, x - tl.sum(x, axis=0) / n_cols, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        y = xc * inv * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            y += tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        _store(y_row, q_row, QM, cols, m, y, zshift, QUANT, FP8, EXACT)
    else:
        mean = 0.0
        if not RMS:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for off in range(0, n_cols, BLOCK):
                c = off + cols
                acc += _row(x_row, r_row, c, c < n_cols, HAS_R)
            mean = tl.sum(acc, axis=0) / n_cols
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, n_cols, BLOCK):
            c = off + cols
            x = _row(x_row, r_row, c, c < n_cols, HAS_R)
            xc = tl.where(c < n_cols, x - mean, 0.0)
            acc2 += xc * xc
        inv = 1.0 / tl.sqrt(tl.sum(acc2, axis=0) / n_cols + eps)
        for off in range(0, n_cols, BLOCK):
            c = off + cols
            m = c < n_cols
            x = _row(x_row, r_row, c, m, HAS_R)
            y = (x - mean) * inv * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
            if HAS_B:
                y += tl.load(B + c, mask=m, other=0.0).to(tl.float32)
            _store(y_row, q_row, QM, c, m, y, zshift, QUANT, FP8, EXACT)


@jit(do_not_specialize=["n_rows"])
def _norm_tile_kernel(X, W, B, Y, R, n_rows, stride_x, stride_y, stride_r, n_cols, eps,
                      HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr,
                      ROWS: tl.constexpr, HAS_R: tl.constexpr):
    """ROWS whole rows (each within one BLOCK) per program. A short row (BERT's 768) is a
    warp's work, and programs of one warp each cap an SM at 32 of them (half its warps);
    ROWS rows over num_warps warps keep more loads in flight."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    m = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_R:
        x += tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=m,
                     other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        xc = tl.where(m, x - (tl.sum(x, axis=1) / n_cols)[:, None], 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    cm = cols < n_cols
    y = xc * inv[:, None] * tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y += tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


def _row_len(n, x) -> int:
    ax = norm_axis(n.a.axis if n.a.axis is not None else -1, x.dim())
    return x.shape[ax:].numel()


def supports(n, inputs) -> bool:
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    if n.n_out != 1 or not on_device(x, scale, bias) or x.dtype not in FLOATS:
        return False
    if getattr(n.a, "stash_type", 1) not in (None, 1):  # statistics in fp32 only
        return False
    rows = _row_len(n, x)
    full = tuple(x.shape[x.dim() - scale.dim():]) if scale.dim() <= x.dim() else None
    return (rows > 0 and scale.numel() == rows and full == tuple(scale.shape)
            and (bias is None or tuple(bias.shape) == tuple(scale.shape)))


def tactics(n, inputs) -> list[dict]:
    cols = next_pow2(_row_len(n, inputs[0]))
    blocks = sorted({min(cols, b) for b in (cols, 1024, 4096)})
    return [{"BLOCK": b, "num_warps": w} for b in blocks
            for w in sorted({1, 2, 4, 8, 16} & set(range(1, max(2, b // 32) + 1)))]


# (ROWS, num_warps) of the multi-row tile, for rows of at most TILE_COLS (padded) elements
ROW_TILES = ((4, 4), (8, 4), (8, 8), (16, 8))
TILE_COLS = 2048
SMS = 132  # an H100/H200's SM count


def row_tiles(block: int, rows: int) -> list[dict]:
    """Multi-row tactics for ``rows`` rows of ``block`` (a power of two) padded columns: where
    a row is short and a tile's worth of rows per SM is there to take."""
    if block > TILE_COLS:
        return []
    return [{"BLOCK": block, "num_warps": w, "ROWS": r} for r, w in ROW_TILES
            if r * SMS <= rows and r * block <= 16384]


def row_tactics(n, inputs) -> list[dict]:
    """LayerNorm/RMSNorm: one row a program (:func:`tactics`) and the multi-row tiles."""
    x = inputs[0]
    cols = _row_len(n, x)
    return tactics(n, inputs) + row_tiles(next_pow2(cols), x.numel() // max(1, cols))


def _launch(n, x, scale, bias, rms: bool):
    cols = _row_len(n, x)
    eps = n.a.epsilon if n.a.epsilon is not None else 1e-5
    block = min(next_pow2(cols), 8192)
    t = tactic_of(n, {"BLOCK": block, "num_warps": warps_for(block)})
    return norm_rows(x, scale, bias, cols, float(eps), rms, t["BLOCK"], t["num_warps"],
                     rows=t.get("ROWS", 1))


def norm_rows(x, scale, bias, cols: int, eps: float, rms: bool, block: int, num_warps: int,
              res=None, out=None, quant=None, rows: int = 1):
    """LayerNorm (``rms``: RMSNorm) of ``x (+ res)`` over rows of ``cols`` elements, into
    ``out`` (default: a new tensor; ``x`` itself works: each row is read before it is
    written). ``res``: x's shape and layout. ``quant``: ``(codes, qmul, zshift, fp8)``: the
    output's codes too, into ``codes`` (contiguous, x's shape). ``rows`` > 1 (no ``quant``,
    rows within one ``block``): that many rows a program."""
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    r2 = x2 if res is None else res.reshape(-1, cols)
    if r2.stride(-1) != 1:  # the kernel reads a row's elements one after another
        r2 = r2.contiguous()
    w = scale.contiguous()
    b = bias.contiguous() if bias is not None else w
    if rows > 1 and block >= cols and quant is None:
        launch(_norm_tile_kernel, (cdiv(x2.shape[0], rows),), x2, w, b, y, r2, x2.shape[0],
               x2.stride(0), cols, r2.stride(0), cols, eps, HAS_B=bias is not None, RMS=rms,
               BLOCK=block, ROWS=rows, HAS_R=res is not None, num_warps=num_warps)
        return y
    q, qm, zshift, fp8 = (y, w, 0, False) if quant is None else quant
    launch(
        _norm_kernel, (x2.shape[0],), x2, w, b, y, r2, q, qm, x2.stride(0), cols,
        r2.stride(0), cols, eps, int(zshift), HAS_B=bias is not None, RMS=rms, BLOCK=block,
        ONE_BLOCK=block >= cols, num_warps=num_warps, HAS_R=res is not None,
        QUANT=quant is not None, FP8=bool(fp8), EXACT=INTERPRET)
    return y


@register(N.LayerNormalization, backend="cuda", name="TritonLayerNorm", tactics=row_tactics,
          supports=supports)
def layer_norm(n, x, scale, bias=None):
    if not supports(n, (x, scale, bias)):
        return torch_norm.layer_norm(n, x, scale, bias)
    return _launch(n, x, scale, bias, rms=False)


@register(N.RMSNormalization, backend="cuda", name="TritonRMSNorm", tactics=row_tactics,
          supports=supports)
def rms_norm(n, x, scale):
    if not supports(n, (x, scale)):
        return torch_norm.rms_norm(n, x, scale)
    return _launch(n, x, scale, None, rms=True)


def _supports_quant(n, inputs) -> bool:
    x = inputs[0]
    return (supports(dataclasses.replace(n, n_out=1), inputs[:3])
            and _row_len(n, x) == x.shape[-1] and x.is_contiguous()
            and inputs[3] is not None and inputs[3].numel() == x.shape[-1])


@register(I8.LayerNormQuant, backend="cuda", name="TritonLayerNormQuant", tactics=tactics,
          supports=_supports_quant)
def layer_norm_quant(n, x, scale, bias, qmul):
    """LayerNormalization over the last axis, its output also written as int8/e4m3 codes."""
    if not _supports_quant(n, (x, scale, bias, qmul)):
        return torch_int8.layer_norm_quant(n, x, scale, bias, qmul)
    a = n.a
    cols = x.shape[-1]
    block = min(next_pow2(cols), 8192)
    t = tactic_of(n, {"BLOCK": block, "num_warps": warps_for(block)})
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn if a.fp8 else torch.int8,
                        device=x.device)
    y = norm_rows(x, scale, bias, cols, float(a.epsilon), False, t["BLOCK"], t["num_warps"],
                  quant=(codes, qmul, a.zshift, a.fp8))
    return y, codes
