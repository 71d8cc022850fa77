"""Triton kernels that fuse a decode layer's small ops (one launch each instead of several)::

    add_rms_norm   x, r -> s = x + r; y = s * rsqrt(mean(s^2) + eps) * w        grid (T,)
    silu_mul       [g | u] -> silu(g) * u                                         grid (T, I / B)
    rope_kv        qkv -> q rotated to q_out; k rotated and v written to their    grid (T, H + KV)
                   cache slots (rotate-half RoPE, cos/sin rows gathered by position;
                   an FP8 cache gets k / sk and v / sv saturated at +-448 in e4m3);
                   optionally the rotated k too (a prefill attends over it unquantized)
    quantize_rows  x [M, K] -> e4m3 codes of x / sx and sx = max|x| / 448 per row  grid (M,)
                   (the FP8 GEMMs' activation quantize: absmax, scale and cast in one pass
                   pair instead of six torch ops)

Each computes in float32 and rounds once to the activations' dtype. ``fused.py`` picks these
or the torch ops they replace; tested under ``TRITON_INTERPRET=1`` against those torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, H, eps, HAS_R: tl.constexpr,
                  BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < H
    x = tl.load(x_ptr + t * H + c, mask=mask, other=0.0)
    if HAS_R:
        x = x + tl.load(r_ptr + t * H + c, mask=mask, other=0.0)  # rounded as torch's add
        tl.store(s_ptr + t * H + c, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * H + c, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, RMSNorm(x + r) * w) for x, r [T, H] contiguous; r None: (x, RMSNorm(x) * w)."""
    t, h = x.shape
    s = x if r is None else torch.empty_like(x)
    y = torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _add_rms_norm[(t,)](x, x if r is None else r, w, s, y, h, eps, HAS_R=r is not None,
                        BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return s, y


@triton.jit
def _silu_mul(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n
    g = tl.load(gu_ptr + t * 2 * n + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * n + n + c, mask=mask, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * n + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I] contiguous."""
    t, i2 = gu.shape
    i = i2 // 2
    out = torch.empty(t, i, dtype=gu.dtype, device=gu.device)
    _silu_mul[(t, triton.cdiv(i, block))](gu, out, i, BLOCK=block)
    return out


@triton.jit
def _to_e4m3(x, scale):
    """x / scale saturated at +-448, rounded to 3 mantissa bits (to nearest, ties to even)
    in float32 bits, so the cast to e4m3 that follows is exact (normal range). The cast alone
    would round the same on the GPU; Triton's interpreter does not carry a round-up into the
    exponent (30.6 became 16), and the tests run there."""
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # drop 20 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, in steps of 2^-9: round there (adding and taking away
    # 1.5 * 2^23 rounds to an integer, ties to even), or the GPU's cast rounds a second time
    sub = ((y * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    return tl.where(tl.abs(y) < 0.015625, sub, normal).to(tl.float8e4nv)


@triton.jit
def _rope_kv(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, kv_scale_ptr,
             k_out_ptr, stride_t, stride_slot, H: tl.constexpr, KV: tl.constexpr,
             D: tl.constexpr, FP8_KV: tl.constexpr, K_OUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # heads 0..H-1 are q, H..H+KV-1 are k (with their v)
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)  # rotate_half([a, b]) = [-b, a]
    p = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + p * D + d).to(tl.float32)
    sin = tl.load(sin_ptr + p * D + d).to(tl.float32)
    src = qkv_ptr + t * stride_t + j * D
    x = tl.load(src + d).to(tl.float32)
    xr = tl.load(src + partner).to(tl.float32) * sign
    out = x * cos + xr * sin
    if j < H:
        tl.store(q_ptr + (t * H + j) * D + d, out.to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = slot * stride_slot + (j - H) * D + d
        v = tl.load(src + KV * D + d)
        if K_OUT:  # the rotated k in the activations' dtype too (attention over fresh keys)
            tl.store(k_out_ptr + (t * KV + j - H) * D + d, out.to(k_out_ptr.dtype.element_ty))
        if FP8_KV:  # no reassignment: Triton wants one type per name across the branches
            tl.store(k_ptr + dst, _to_e4m3(out, tl.load(kv_scale_ptr)))
            tl.store(v_ptr + dst, _to_e4m3(v, tl.load(kv_scale_ptr + 1)))
        else:
            tl.store(k_ptr + dst, out.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty))


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
            kv_heads: int, head_dim: int, kv_scale: torch.Tensor | None = None,
            with_k: bool = False):
    """q [T, heads, head_dim] rotated; k rotated and v written at ``slots`` of the caches;
    ``with_k``: (q, k [T, kv_heads, head_dim] rotated, in qkv's dtype) instead of q.

    qkv [T, (heads + 2 kv_heads) * head_dim] (rows may be strided, each row contiguous);
    cos, sin [max_position, head_dim] contiguous; positions, slots [T]; k_cache, v_cache
    [slots, kv_heads, head_dim] with contiguous (kv_heads, head_dim), in qkv's dtype or
    float8_e4m3fn with ``kv_scale`` (float32 [K scale, V scale] on the device).
    """
    t = qkv.shape[0]
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    if fp8_kv and kv_scale is None:
        raise ValueError("rope_kv: an FP8 KV cache needs kv_scale")
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if with_k else q
    _rope_kv[(t, heads + kv_heads)](qkv, cos, sin, positions, slots, q, k_cache, v_cache,
                                    kv_scale if fp8_kv else cos, k, qkv.stride(0),
                                    k_cache.stride(0), H=heads, KV=kv_heads, D=head_dim,
                                    FP8_KV=fp8_kv, K_OUT=with_k)
    return (q, k) if with_k else q


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + r * stride_x + k0 + c, mask=k0 + c < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    a = tl.max(amax, 0)
    sx = tl.where(a > 0, a / 448.0, 1.0)
    tl.store(s_ptr + r, sx)
    for k0 in range(0, K, BLOCK):
        mask = k0 + c < K
        x = tl.load(x_ptr + r * stride_x + k0 + c, mask=mask, other=0.0)
        tl.store(q_ptr + r * K + k0 + c, _to_e4m3(x, sx), mask=mask)


def quantize_rows(x2: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, K] contiguous, sx float32 [M, 1]) with x2 ~= q * sx, one scale a
    row (``fp8.quantize_rows`` in one launch). x2 [M, K], each row contiguous."""
    m, k = x2.shape
    if x2.stride(1) != 1:
        raise ValueError(f"quantize_rows: x [{m}, {k}] needs contiguous rows")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    sx = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    _quantize_rows[(m,)](x2, q, sx, k, x2.stride(0), BLOCK=min(block, triton.next_power_of_2(k)))
    return q, sx
