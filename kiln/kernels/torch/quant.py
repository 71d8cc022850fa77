"""PyTorch kernels: Cast, CastLike and BitCast (the quantization ops are in quant_linear.py).

Casts between dtypes torch has run as torch ops (on the device the input is on), the
non-saturating float8 conversions too. Dtypes torch lacks (int4/uint4/int2/uint2, float4e2m1,
float6, strings) go through numpy with ml_dtypes, which rounds to nearest-even exactly as the
ONNX reference does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE, dtype_of, to_numpy, to_torch
from kiln.ops import quant as Q

FLOAT8 = (DType.float8e4m3fn, DType.float8e4m3fnuz, DType.float8e5m2, DType.float8e5m2fnuz)
# packed types: one numpy byte per value, but fewer bits, so never bit-compatible with a byte
_SUBBYTE = {DType.int4, DType.uint4, DType.int2, DType.uint2, DType.float4e2m1,
            DType.float6e2m3, DType.float6e3m2}
FLOAT8_TORCH = tuple(TORCH_DTYPE[d] for d in FLOAT8) + (torch.float8_e8m0fnu,)


def _float_source(x: torch.Tensor) -> torch.Tensor:
    """A float tensor torch can clamp and round: ints, bools and float8 widen first."""
    if x.dtype in FLOAT8_TORCH or x.dtype == torch.bool:
        return x.to(torch.float32)
    if not x.is_floating_point():
        return x.to(torch.float64 if x.element_size() >= 4 else torch.float32)
    return x


def _saturate_f8(x: torch.Tensor, tdt: torch.dtype) -> torch.Tensor:
    """Out-of-range values (and +-inf) become +-max finite; NaN stays NaN (clamp keeps it)."""
    info = torch.finfo(tdt)
    return _float_source(x).clamp(info.min, info.max).to(tdt)


# non-saturating float8: |x| past this overflows (after round-to-nearest-even; ``strict``: the
# halfway value itself rounds down to max, whose mantissa is even) to NaN, or inf for e5m2
_F8_OVERFLOW = {DType.float8e4m3fn: (464.0, True, float("nan")),
                DType.float8e4m3fnuz: (248.0, False, float("nan")),
                DType.float8e5m2: (61440.0, False, float("inf")),
                DType.float8e5m2fnuz: (61440.0, False, float("nan"))}


def _overflow_f8(x: torch.Tensor, to: DType, tdt: torch.dtype) -> torch.Tensor:
    """Cast with ONNX's saturate=0: in-range values round as torch rounds them, values that
    round past the largest finite one (and +-inf) become NaN (+-inf for e5m2)."""
    lim, strict, special = _F8_OVERFLOW[to]
    f = _float_source(x).to(torch.float32)
    info = torch.finfo(tdt)
    y = f.clamp(info.min, info.max).to(tdt).to(torch.float32)
    a = f.abs()
    over = a > lim if strict else a >= lim
    y = torch.where(over, torch.copysign(torch.full_like(f, special), f), y)
    return y.to(tdt)


def to_e8m0(x: torch.Tensor, saturate: bool, round_mode: str) -> torch.Tensor:
    """float -> float8e8m0 (an 8-bit power-of-two exponent) on the float32 bit pattern, with
    the ONNX rounding modes: 'up' (any fraction bumps the exponent), 'down', 'nearest'."""
    bits = _float_source(x).to(torch.float32).view(torch.int32)
    exp = (bits >> 23) & 0xFF
    special = exp == 0xFF  # inf and NaN both map to the NaN encoding
    if round_mode == "up":
        bump = (bits & 0x7FFFFF) != 0
    elif round_mode == "down":
        bump = torch.zeros_like(special)
    elif round_mode == "nearest":
        guard, rnd = (bits & 0x400000) != 0, (bits & 0x200000) != 0
        sticky = (bits & 0x1FFFFF) != 0
        bump = guard & (rnd | sticky | (exp > 0))
    else:
        raise ValueError(f"Cast: unknown round_mode {round_mode!r}")
    bump = bump & ~special
    if saturate:  # the largest exponent never rounds up into the NaN encoding
        bump = bump & (exp != 0xFE)
    out = torch.where(special, 0xFF, exp + bump.to(torch.int32))
    return out.to(torch.uint8).view(torch.float8_e8m0fnu)


def _np_from_strings(a: np.ndarray, to: DType) -> np.ndarray:
    flat = [str(s) for s in a.reshape(-1)]
    if to == DType.bool or (to.is_int and to.np.kind in "iu"):
        # ints parse exactly; numbers written as floats ('2.0') go through float
        try:
            return np.array([int(s) for s in flat], dtype=to.np).reshape(a.shape)
        except ValueError:
            pass
    vals = np.array([float(s) for s in flat], dtype=np.float64).reshape(a.shape)
    return vals.astype(to.np) if to.np.kind in "fciub" else vals.astype(np.float32)


def _to_strings(a: np.ndarray) -> np.ndarray:
    if a.dtype == object:
        return a.copy()
    if a.dtype.kind not in "fciub":  # ml_dtypes types: print their value as a builtin type
        a = a.astype(np.int64 if DType.from_np(a.dtype).is_int else np.float32)
    return a.astype(np.str_).astype(object)


def _np_cast(x, to: DType, saturate: bool, round_mode: str):
    """The general path: numpy + ml_dtypes (mirrors the ONNX reference's ``astype``)."""
    a = to_numpy(x)
    if to == DType.string:
        return _to_strings(a)
    if a.dtype == object:
        a = _np_from_strings(a, to if to.np.kind in "fciub" else DType.float32)
        if a.dtype == to.np:
            return to_torch(a)
    if to in FLOAT8 and saturate:
        info = ml_dtypes.finfo(to.np)
        a = np.clip(a.astype(np.float32) if a.dtype.kind not in "f" else a, info.min, info.max)
    elif to == DType.float8e8m0:
        return to_e8m0(torch.from_numpy(np.array(a, dtype=np.float32)), saturate, round_mode)
    with np.errstate(all="ignore"):
        return to_torch(np.asarray(a).astype(to.np))


def cast(x, to: DType, saturate: bool = True, round_mode: str = "up"):
    """Cast ``x`` (torch tensor or numpy array) to ``to`` with ONNX semantics."""
    tdt = TORCH_DTYPE.get(to)
    if not isinstance(x, torch.Tensor) or tdt is None:
        return _np_cast(x, to, saturate, round_mode)
    if x.dtype == tdt:
        return x
    if to == DType.float8e8m0:
        return to_e8m0(x, saturate, round_mode)
    if to in FLOAT8:
        # torch saturates e4m3fn overflow instead of making NaN: overflow is set apart
        return _saturate_f8(x, tdt) if saturate else _overflow_f8(x, to, tdt)
    try:
        return x.to(tdt)
    except (RuntimeError, TypeError):  # a pair torch has no direct conversion for
        return x.to(torch.float32).to(tdt)


@register(Q.Cast)
def cast_kernel(n, x):
    return cast(x, Q.cast_target(n.a.to), bool(n.a.saturate), n.a.round_mode or "up")


@register(Q.CastLike)
def cast_like(n, x, like):
    return cast(x, dtype_of(like), bool(n.a.saturate), n.a.round_mode or "up")


@register(Q.BitCast)
def bitcast(n, x):
    to = Q.cast_target(n.a.to)
    src = dtype_of(x)
    if DType.string in (src, to):
        raise ValueError("BitCast: strings have no bit pattern")
    if src.np.itemsize != to.np.itemsize or (src in _SUBBYTE) != (to in _SUBBYTE):
        raise ValueError(f"BitCast: {src} and {to} differ in bit width")
    tdt = TORCH_DTYPE.get(to)
    if isinstance(x, torch.Tensor) and tdt is not None:
        return x.view(tdt).clone()  # a new value: outputs never alias their inputs
    return to_torch(np.array(to_numpy(x)).view(to.np))
