"""Paged decode attention in Triton: split-K over the context, the query heads of one KV head
packed into one tile (GQA), then a reduction over the splits.

    grid (seq, kv_head, split): q[group, D] . K[block]^T -> online softmax -> partial (acc, m, l)
    grid (seq, head):           out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s

(with one split, as from 17 sequences on for 32 KV heads, the first kernel writes acc / l
itself and the reduction is not launched: one kernel a layer fewer.)

Each split covers ceil(len / SPLITS) tokens rounded up to whole blocks, computed in the kernel
from the sequence's length, so the launch has no per-step arguments (CUDA-graph safe). Tested
under ``TRITON_INTERPRET=1`` on small shapes; the speed is the GPU's business.

An FP8 (e4m3) cache (``kv_scale`` given: [K scale, V scale] float32 on the device) is loaded as
FP8 tiles and widened to the queries' dtype in registers (exact: every e4m3 value is an FP16
value); the K scale is folded into the softmax scale, the V scale applied to the partial
output, so dequantizing costs two multiplies per program. Half the bytes of an FP16 cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# the splits and the tables' row stride change with the batch: not specialized (Triton would
# compile again whenever one became 1 or a multiple of 16)
@triton.jit(do_not_specialize=["stride_tb", "SPLITS"])
def _decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr, kv_scale_ptr,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, scale,
                  SPLITS, HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  D: tl.constexpr, BS: tl.constexpr, FP8_KV: tl.constexpr,
                  TILE: tl.constexpr,
                  stride_ob=0, stride_oh=0, DIRECT: tl.constexpr = False):
    # TILE tokens per iteration (the dot tile, 16 or more: tl.dot's least rows): one block
    # (TILE == BS), or each token's block looked up on its own (a tile spans TILE / BS blocks,
    # or part of one). SPLITS is a runtime value: one compile serves every batch size.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    per = ((n + SPLITS - 1) // SPLITS + TILE - 1) // TILE * TILE
    start = sp * per
    end = tl.minimum(start + per, n)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None], other=0.0)
    qk_scale = scale
    if FP8_KV:  # s = q . (k8 * sk) * scale = (q . k8) * (scale * sk)
        qk_scale = scale * tl.load(kv_scale_ptr)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for pos in range(start, end, TILE):
        valid = pos + t < end
        if TILE == BS:
            blk = tl.load(tables_ptr + b * stride_tb + pos // BS).to(tl.int64)
            off = blk * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        else:
            tok = pos + t
            blks = tl.load(tables_ptr + b * stride_tb + tok // BS, mask=valid,
                           other=0).to(tl.int64)
            off = (blks[:, None] * stride_kb + (tok % BS)[:, None] * stride_kt
                   + kvh * stride_kh + d[None, :])
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        if FP8_KV:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    if FP8_KV:  # sum p (v8 * sv) = sv * sum p v8
        acc = acc * tl.load(kv_scale_ptr + 1)
    if DIRECT:  # one split: the output itself (acc_ptr is out), no partials to reduce
        o = acc / lsum[:, None]
        tl.store(acc_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(acc_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        row = (b * HEADS + heads) * SPLITS + sp
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, lsum, mask=gmask)


@triton.jit(do_not_specialize=["stride_tb", "SPLITS"])
def _decode_split_kq(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr, kv_scale_ptr,
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, scale,
                     SPLITS, HEADS: tl.constexpr, GROUP: tl.constexpr,
                     GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     FP8_KV: tl.constexpr, TILE: tl.constexpr,
                     stride_ob=0, stride_oh=0, DIRECT: tl.constexpr = False):
    """``_decode_split`` with the scores made as K . q^T ([TILE, GROUP_PAD]: the K tile, widened
    from FP8 in registers, is the dot's first operand, which Hopper's MMA may read from
    registers; in ``_decode_split`` it is the second, staged through shared memory), then
    P^T . V as before. Same partials (acc, m, l), same reduction."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    per = ((n + SPLITS - 1) // SPLITS + TILE - 1) // TILE * TILE
    start = sp * per
    end = tl.minimum(start + per, n)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    qt = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + d[:, None],
                 mask=gmask[None, :], other=0.0)  # [D, GROUP_PAD]
    qk_scale = scale
    if FP8_KV:
        qk_scale = scale * tl.load(kv_scale_ptr)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for pos in range(start, end, TILE):
        tok = pos + t
        valid = tok < end
        blks = tl.load(tables_ptr + b * stride_tb + tok // BS, mask=valid, other=0).to(tl.int64)
        off = (blks[:, None] * stride_kb + (tok % BS)[:, None] * stride_kt + kvh * stride_kh
               + d[None, :])
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        if FP8_KV:
            k = k.to(qt.dtype)
            v = v.to(qt.dtype)
        st = tl.dot(k, qt).to(tl.float32) * qk_scale  # [TILE, GROUP_PAD]
        st = tl.where(valid[:, None], st, float("-inf"))
        m_new = tl.maximum(m, tl.max(st, 0))
        alpha = tl.exp(m - m_new)
        pt = tl.exp(st - m_new[None, :])
        lsum = lsum * alpha + tl.sum(pt, 0)
        acc = acc * alpha[:, None] + tl.dot(tl.trans(pt).to(v.dtype), v).to(tl.float32)
        m = m_new
    if FP8_KV:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if DIRECT:  # one split: the output itself (acc_ptr is out), no partials to reduce
        o = acc / lsum[:, None]
        tl.store(acc_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(acc_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        row = (b * HEADS + heads) * SPLITS + sp
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, lsum, mask=gmask)


@triton.jit
def _tile_rows(tables_ptr, b, stride_tb, tok, end, h, stride_kb, stride_kt, stride_kh, d,
               BS: tl.constexpr):
    """(each token's offset [TILE, D] in the cache, the valid tokens [TILE]) of one tile."""
    valid = tok < end
    blk = tl.load(tables_ptr + b * stride_tb + tok // BS, mask=valid, other=0).to(tl.int64)
    off = (blk[:, None] * stride_kb + (tok % BS)[:, None] * stride_kt + h * stride_kh
           + d[None, :])
    return off, valid


@triton.jit
def _tile_update(q, k, v, valid, m, lsum, acc, qk_scale):
    """The online softmax over one tile's float32 K, V [TILE, D]: (m, lsum, acc) updated."""
    s = tl.sum(q[None, :] * k, 1) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    lsum = lsum * alpha + tl.sum(p, 0)
    acc = acc * alpha + tl.sum(p[:, None] * v, 0)
    return m_new, lsum, acc


@triton.jit(do_not_specialize=["stride_tb", "SPLITS"])
def _decode_split_tiles(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr,
                        kv_scale_ptr, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_tb, scale, SPLITS, HEADS: tl.constexpr, D: tl.constexpr,
                        BS: tl.constexpr, TILE: tl.constexpr, FP8_KV: tl.constexpr,
                        stride_ob=0, stride_oh=0, DIRECT: tl.constexpr = False,
                        PREFETCH: tl.constexpr = False):
    """The MHA variant (one query head per KV head): TILE tokens per iteration, each token's
    block looked up on its own (a tile spans TILE / BS blocks), scores and the weighted sum of
    V as elementwise products and sums in float32 instead of a 16-row padded tl.dot.
    PREFETCH: the next tile's block ids, K and V are loaded before this tile is computed
    (carried through the loop in the cache's dtype: two tiles in flight a program, whatever
    the compiler's pipelining does with loads whose addresses come from loads)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    per = ((n + SPLITS - 1) // SPLITS + TILE - 1) // TILE * TILE
    start = sp * per
    end = tl.minimum(start + per, n)
    d = tl.arange(0, D)
    t = tl.arange(0, TILE)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
    qk_scale = scale
    if FP8_KV:
        qk_scale = scale * tl.load(kv_scale_ptr)
    m = float("-inf")
    lsum = 0.0
    acc = tl.zeros([D], tl.float32)
    if PREFETCH:
        off, valid = _tile_rows(tables_ptr, b, stride_tb, start + t, end, h, stride_kb,
                                stride_kt, stride_kh, d, BS)
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        for pos in range(start, end, TILE):
            off_n, valid_n = _tile_rows(tables_ptr, b, stride_tb, pos + TILE + t, end, h,
                                        stride_kb, stride_kt, stride_kh, d, BS)
            k_n = tl.load(k_ptr + off_n, mask=valid_n[:, None], other=0.0)
            v_n = tl.load(v_ptr + off_n, mask=valid_n[:, None], other=0.0)
            m, lsum, acc = _tile_update(q, k.to(tl.float32), v.to(tl.float32), valid, m, lsum,
                                        acc, qk_scale)
            k, v, valid = k_n, v_n, valid_n
    else:
        for pos in range(start, end, TILE):
            off, valid = _tile_rows(tables_ptr, b, stride_tb, pos + t, end, h, stride_kb,
                                    stride_kt, stride_kh, d, BS)
            k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
            m, lsum, acc = _tile_update(q, k, v, valid, m, lsum, acc, qk_scale)
    if FP8_KV:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if DIRECT:  # one split: the output itself (acc_ptr is out)
        o = acc / lsum
        tl.store(acc_ptr + b * stride_ob + h * stride_oh + d, o.to(acc_ptr.dtype.element_ty))
    else:
        row = (b * HEADS + h) * SPLITS + sp
        tl.store(acc_ptr + row * D + d, acc)
        tl.store(ml_ptr + row * 2, m)
        tl.store(ml_ptr + row * 2 + 1, lsum)


@triton.jit(do_not_specialize=["SPLITS"])
def _decode_reduce(acc_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, SPLITS,
                   HEADS: tl.constexpr, D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    smask = s < SPLITS
    row = (b * HEADS + h) * SPLITS + s
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    mx = tl.max(m, 0)
    w = tl.where(lsum > 0, tl.exp(m - mx), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_splits(batch: int, kv_heads: int, sms: int = 132) -> int:
    """Context splits per (sequence, KV head): about four programs per SM, 1 to 8. Few
    sequences need the splits to fill the GPU; many fill it alone, and each split costs a
    partial (acc, m, l) written and read back."""
    return max(1, min(8, -(-4 * sms // max(batch * kv_heads, 1))))


def parse_tile(v: str, name: str, least: int = 1) -> tuple[int, int] | None:
    """``N`` or ``N:W`` -> (N, W) (W default 4); "" or "0" -> None. N a power of two, at least
    ``least``; W 1, 2, 4, 8 or 16."""
    if not v or v == "0":
        return None
    try:
        n, _, w = v.partition(":")
        n, w = int(n), int(w or 4)
    except ValueError:
        n = w = 0
    if n < least or n & (n - 1) or w not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}={v}: N or N:W, N a power of two of at least {least} (tokens "
                         "per iteration), W warps (1, 2, 4, 8 or 16)")
    return n, w


def mha_tile_from_env() -> tuple[int, int] | None:
    """``KILN_LLM_DECODE_TILE=N`` or ``N:W``: MHA decode (no GQA) in the tiled kernel, N tokens
    per iteration (a power of two; tiles need not line up with blocks), W warps (default 4);
    0: the tl.dot kernel; unset: None here (CudaModelRunner then picks by the cache's dtype)."""
    import os

    return parse_tile(os.environ.get("KILN_LLM_DECODE_TILE", ""), "KILN_LLM_DECODE_TILE")


def dot_tile_from_env() -> tuple[int, int] | None:
    """``KILN_LLM_DECODE_DOT_TILE=N`` or ``N:W``: the tl.dot kernel's tile, N tokens per
    iteration (a power of two, at least 16), W warps; unset or 0: None (one block, at least 16
    tokens, 4 warps)."""
    import os

    return parse_tile(os.environ.get("KILN_LLM_DECODE_DOT_TILE", ""),
                      "KILN_LLM_DECODE_DOT_TILE", least=16)


KQ = "kq"  # a dot_tile ending in this string: the K . q^T kernel (_decode_split_kq)
PF = "pf"  # an mha_tile ending in this string: the tiled kernel with PREFETCH


def _config(cfg, default_tile: int) -> tuple[int, int, dict]:
    """A kernel configuration N, (N, W) or (N, W, S) -> (tokens, warps, {num_stages: S}
    where given); None -> (default_tile, 4, {}). A trailing ``KQ`` / ``PF`` is no number."""
    if not cfg:
        return default_tile, 4, {}
    cfg = cfg if isinstance(cfg, tuple) else (cfg,)
    cfg = tuple(c for c in cfg if not isinstance(c, str))
    tile, warps = cfg[0], cfg[1] if len(cfg) > 1 else 4
    return tile, warps, {"num_stages": cfg[2]} if len(cfg) > 2 else {}


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 splits: int = 8, kv_scale: torch.Tensor | None = None,
                 mha_tile: int | tuple[int, int] | None = None,
                 dot_tile: int | tuple[int, int] | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys.

    q [B, H, D]; k_cache, v_cache [blocks, block_size, KV, D] (q's dtype, or float8_e4m3fn
    with ``kv_scale`` = float32 [K scale, V scale]); tables [B, max_blocks] int32; lens [B]
    int32 (tokens in the cache, the new one included). Returns [B, H, D]. ``mha_tile``: where
    H == KV, the tiled kernel (``_decode_split_tiles``) with that many tokens per iteration,
    or (tokens, warps). ``dot_tile``: the tl.dot kernel's tokens per iteration (a power of two,
    at least 16), or (tokens, warps); None: one block (at least 16 tokens), 4 warps. Either
    may carry a third number, Triton's num_stages (the loop's software pipelining depth); a
    dot_tile tuple ending in ``KQ`` ("kq") runs ``_decode_split_kq`` (scores as K . q^T), an
    mha_tile tuple ending in ``PF`` ("pf") the tiled kernel with PREFETCH.
    """
    b, heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    group = heads // kv
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    if fp8_kv != (kv_scale is not None) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode: K cache {k_cache.dtype}, V cache {v_cache.dtype}, "
                         f"kv_scale {'given' if kv_scale is not None else 'None'}: an FP8 cache "
                         "needs kv_scale, any other none")
    out = torch.empty_like(q)
    direct = splits == 1  # the split kernel writes the output: no reduction launched
    if direct:
        acc = ml = out
        extra = dict(stride_ob=out.stride(0), stride_oh=out.stride(1), DIRECT=True)
    else:
        acc = torch.empty(b * heads * splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(b * heads * splits, 2, dtype=torch.float32, device=q.device)
        extra = {}
    if mha_tile and group == 1:
        tile, warps, stages = _config(mha_tile, mha_tile)
        if isinstance(mha_tile, tuple) and mha_tile[-1] == PF:
            extra["PREFETCH"] = True
        _decode_split_tiles[(b, kv, splits)](
            q, k_cache, v_cache, tables, lens, acc, ml, kv_scale if fp8_kv else lens,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            tables.stride(0), scale, splits, HEADS=heads, D=d, BS=bs,
            TILE=tile, FP8_KV=fp8_kv, num_warps=warps, **stages, **extra)
    else:
        tile, warps, stages = _config(dot_tile, max(16, bs))
        if tile < 16 or tile & (tile - 1):
            raise ValueError(f"paged_decode: dot_tile {tile}: a power of two of at least 16")
        kq = isinstance(dot_tile, tuple) and dot_tile[-1] == KQ
        (_decode_split_kq if kq else _decode_split)[(b, kv, splits)](
            q, k_cache, v_cache, tables, lens, acc, ml, kv_scale if fp8_kv else lens,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            tables.stride(0), scale, splits, HEADS=heads, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BS=bs,
            FP8_KV=fp8_kv, TILE=tile, num_warps=warps, **stages, **extra)
    if direct:
        return out
    _decode_reduce[(b, heads)](acc, ml, out, out.stride(0), out.stride(1), splits, HEADS=heads,
                               D=d, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return out
