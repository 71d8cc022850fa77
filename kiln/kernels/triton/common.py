"""What the Triton kernels share: device checks, tactic lookup, math helpers as ``@jit``.

Triton's interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors, so CPU-only CI covers
them; it has no libdevice, so tanh, pow and friends are written here from exp/log.
"""

from __future__ import annotations

import os

import torch

from kiln.kernels.triton.binary import launch
from kiln.kernels.triton.lazy import cdiv, jit, tl

# read once: Triton picks the interpreter as each kernel is materialized (lazy.jit), not per call
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)

# epilogue activation name (kiln.ops.fused_conv.ACTIVATIONS) -> constexpr code of act()
ACT_CODE = {"": 0, "Relu": 1, "Clip": 2, "Sigmoid": 3, "Tanh": 4, "Silu": 5, "Gelu": 6,
            "GeluTanh": 7, "HardSwish": 8, "LeakyRelu": 9}


def on_device(*ts) -> bool:
    """True when every tensor is where Triton can run on it (CUDA, or anywhere in the
    interpreter)."""
    return all(t is None or (isinstance(t, torch.Tensor) and (INTERPRET or t.is_cuda))
               for t in ts)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def tactic_of(n, default: dict) -> dict:
    """The tactic the builder chose for this node (``Call.tactic``), else ``default``."""
    t = getattr(n, "tactic", None)
    return dict(default, **t) if t else default


def warps_for(block: int) -> int:
    return max(1, min(16, block // 256))


@jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@jit
def tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@jit
def gelu_tanh(x):
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@jit
def pow_(x, y):
    r = tl.exp2(y * tl.log2(tl.abs(x)))
    y_int = tl.floor(y) == y
    odd = y_int & ((tl.floor(y * 0.5) * 2.0) != y)
    r = tl.where((x < 0) & odd, -r, r)
    r = tl.where((x < 0) & (~y_int), float("nan"), r)
    return tl.where(y == 0, 1.0, r)


@jit
def act(x, ACT: tl.constexpr, alpha, beta):
    """The fused-op epilogues, by ACT_CODE (alpha/beta: Clip's min/max, LeakyRelu's slope)."""
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = tl.minimum(tl.maximum(x, alpha), beta)
    elif ACT == 3:
        x = sigmoid(x)
    elif ACT == 4:
        x = tanh(x)
    elif ACT == 5:
        x = x * sigmoid(x)
    elif ACT == 6:
        x = gelu(x)
    elif ACT == 7:
        x = gelu_tanh(x)
    elif ACT == 8:
        x = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    elif ACT == 9:
        x = tl.where(x >= 0, x, x * alpha)
    return x



@jit
def e4m3(y, EXACT: tl.constexpr):
    """``y`` (float32, within +-448) as float8 e4m3, rounded to nearest, ties to even. The
    GPU's cast rounds so; Triton's interpreter does not (it drops a carry into the exponent:
    7.9 became 4), so there (``EXACT``) the rounding is done in float32 bits first and the
    cast that follows is exact (as kiln.llm.triton_fused does for its FP8 K/V)."""
    if EXACT:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits
        normal = bits.to(tl.float32, bitcast=True)
        # subnormals (below 2^-6) are steps of 2^-9: +- 1.5 * 2^23 rounds to an integer
        sub = ((y * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
        y = tl.where(tl.abs(y) < 0.015625, sub, normal)
    return y.to(tl.float8e4nv)


@jit
def quantize8(y, scale, shift, FP8: tl.constexpr, EXACT: tl.constexpr):
    """An fp32 tile as the codes of an INT8/FP8 layer's input: int8 ``clamp(floor(y / s +
    0.5) + shift, -128, 127)`` or e4m3 ``y / s`` saturated at 448 (s: ``scale``)."""
    if FP8:  # one return: a compiled Triton function's returns must share one type
        q = e4m3(tl.minimum(tl.maximum(y / scale, -448.0), 448.0), EXACT)
    else:
        q = tl.floor(y / scale + 0.5) + shift
        q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int8)
    return q


def channels_last_out(x, channels: int, oh: int, ow: int):
    """An empty channels-last [N, channels, oh, ow] output like ``x`` (dtype, device)."""
    return torch.empty((x.shape[0], channels, oh, ow), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last)


@jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid`` over an [M, N] output in grouped order:
    GROUP_M row blocks in a row share the column (weight) tiles they read while in L2."""
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % width) % group_m, (pid % width) // group_m


@jit
def epilogue(acc, Bias, cols, n_cols, r_ptrs, mask, act_a, act_b,
             HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr):
    """``act(acc + bias[cols] + residual)`` over a [rows, cols] fp32 tile: the fused epilogue
    (``r_ptrs``: the residual's pointers for the tile, read where ``mask``)."""
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    return act(acc, ACT, act_a, act_b)


PIXEL_TILE_KEYS = ("BLOCK_P", "BLOCK_C", "num_warps")


def pixel_channel_tiles(configs, channels: int, pixels: int, default: dict, **extra) -> list:
    """The [BLOCK_P pixels, BLOCK_C channels] tiles of ``configs`` (PIXEL_TILE_KEYS tuples)
    worth timing for an NHWC map: none wider than twice the channels or taller than twice the
    pixels; ``default`` where none fits. ``extra``: keys every tactic carries."""
    out = [dict(zip(PIXEL_TILE_KEYS, c), **extra) for c in configs
           if c[1] <= max(16, 2 * next_pow2(channels)) and c[0] <= max(16, 2 * pixels)]
    return out or [dict(default)]


@jit
def nhwc_pixels(P, OH, OW, BLOCK_P: tl.constexpr):
    """This program's BLOCK_P output pixels of an NHWC map of P = N * OH * OW pixels (axis 0
    of the grid): (flat index, in range, n, oh, ow)."""
    rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    return rp, rp < P, rp // (OW * OH), (rp // OW) % OH, rp % OW


@jit
def window_tap(nb, oh, ow, p_ok, kh, kw, H, W, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w):
    """The input pixel a window's tap (kh, kw) reads for each output pixel, as a flat NHWC
    pixel index, and whether it lies inside the map (padding is a mask)."""
    ih = oh * stride_h - pad_h + kh * dil_h
    iw = ow * stride_w - pad_w + kw * dil_w
    ok = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    return ((nb * H + ih) * W + iw).to(tl.int64), ok


# rows (P) vary per layer: one binary per tile and epilogue, not one per layer shape
@jit(do_not_specialize=["P"])
def bias_act_kernel(Y, Bias, R, P, C, alpha, beta,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                    WIDE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if WIDE:  # 2**31 elements or more
        rows = rows.to(tl.int64)
    offs = rows[:, None] * C + cols[None, :]
    mask = (rows[:, None] < P) & (cols[None, :] < C)
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    y = epilogue(y, Bias, cols, C, R + offs, mask, alpha, beta, HAS_BIAS, HAS_RES, ACT)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def rows_epilogue_(y, c: int, bias=None, res=None, activation: str = "", alpha: float = 0.0,
                   beta: float = 0.0, block: int = 1024, num_warps: int = 4):
    """``y = act(y + bias + res)`` in place on ``y``'s memory seen as [rows, c] contiguous rows
    (a channels-last 4-D map with c = C, or any contiguous tensor with c its last dim); the
    callers check the layout. Returns ``y``."""
    if y.numel() == 0 or (bias is None and res is None and not activation):
        return y
    rows = y.numel() // c
    bc = min(next_pow2(c), block)
    bp = max(1, block // bc)
    launch(bias_act_kernel, (cdiv(rows, bp), cdiv(c, bc)), y, y if bias is None else bias,
           y if res is None else res, rows, c, float(alpha), float(beta),
           HAS_BIAS=bias is not None, HAS_RES=res is not None, ACT=ACT_CODE[activation],
           WIDE=y.numel() >= 2**31, BLOCK_P=bp, BLOCK_C=bc, num_warps=num_warps)
    return y


# the element count varies per layer shape: one binary per epilogue and block (its divisibility
# by 16, which the masked wide loads need, is still specialized on: kept in the key)
@jit
def flat_act_kernel(Y, R, n, alpha, beta, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                    WIDE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:  # 2**31 elements or more
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    y = act(y, ACT, alpha, beta)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def rows_act_(y, res=None, activation: str = "", alpha: float = 0.0, beta: float = 0.0,
              block: int = 2048, num_warps: int = 4, flat: bool = False):
    """``y = act(y + res)`` in place on a contiguous ``y`` seen as [rows, last dim] (``res``:
    contiguous, y's shape): the epilogue of a cuBLAS product whose bias cuBLASLt already
    added. ``flat``: over y's elements as one run, ``block`` a program, instead of [rows,
    cols] tiles (no bias to index by column: the same pass, with no lanes idle where a row is
    not a power of two wide). Returns ``y``."""
    if not y.is_contiguous() or (res is not None and (res.shape != y.shape
                                                      or not res.is_contiguous())):
        raise ValueError("rows_act_: y and the residual must be contiguous, of one shape")
    if not flat:
        return rows_epilogue_(y, y.shape[-1], None, res, activation, alpha, beta, block,
                              num_warps)
    if y.numel() == 0 or (res is None and not activation):
        return y
    launch(flat_act_kernel, (cdiv(y.numel(), block),), y, y if res is None else res,
           y.numel(), float(alpha), float(beta), HAS_RES=res is not None,
           ACT=ACT_CODE[activation], WIDE=y.numel() + block >= 2**31, BLOCK=block,
           num_warps=num_warps)
    return y
