"""PyTorch kernels: elementwise math (arithmetic, comparisons, logic, bitwise).

Activations live in ``math_act.py`` (imported at the bottom so registration happens)."""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.convert import to_numpy, to_torch
from kiln.kernels.torch.util import unsigned_safe
from kiln.ops import math as M

_UINTS = (torch.uint16, torch.uint32, torch.uint64)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_u64(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.uint64 for x in xs)


def _numpy_fallback(np_fn):
    """For uint64 (which torch widens to int64, losing order above 2**63) and strings, compute
    with numpy; everything else goes through the torch kernel."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(n, *xs):
            if _is_u64(*xs) or any(isinstance(x, np.ndarray) for x in xs):
                out = np_fn(n, *[to_numpy(x) for x in xs])
                return to_torch(np.asarray(out))
            return fn(n, *xs)
        return wrapper
    return deco


def _legacy_broadcast(n, b, a):
    """Opset < 7 binary ops broadcast B onto A only when ``broadcast=1``, aligned at ``axis``."""
    if not getattr(n.a, "broadcast", None) or getattr(n.a, "axis", None) is None:
        return b
    if not isinstance(b, torch.Tensor) or b.dim() == 0:
        return b
    axis = n.a.axis + a.dim() if n.a.axis < 0 else n.a.axis
    return b.reshape(b.shape + (1,) * (a.dim() - axis - b.dim()))


def _binary(torch_fn):
    def kernel(n, a, b):
        return torch_fn(a, _legacy_broadcast(n, b, a))
    return kernel


# ---------------------------------------------------------------- arithmetic

register(M.Add)(unsigned_safe(_binary(torch.add)))
register(M.Sub)(unsigned_safe(_binary(torch.sub)))
register(M.Mul)(unsigned_safe(_binary(torch.mul)))


def _np_div(n, a, b):
    if a.dtype.kind in "iu":
        q = np.floor_divide(a, b)
        # numpy floors; ONNX integer division truncates toward zero
        fix = (q < 0) & (q * b != a) if a.dtype.kind == "i" else np.zeros(q.shape, bool)
        return (q + fix).astype(a.dtype)
    return np.divide(a, b).astype(a.dtype)


@register(M.Div)
@_numpy_fallback(_np_div)
@unsigned_safe
def div(n, a, b):
    b = _legacy_broadcast(n, b, a)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


def _np_mod(n, a, b):
    return (np.fmod(a, b) if n.a.fmod else np.mod(a, b)).astype(a.dtype)


@register(M.Mod)
@_numpy_fallback(_np_mod)
@unsigned_safe
def mod(n, a, b):
    if n.a.fmod:
        return torch.fmod(a, b)
    if not a.dtype.is_floating_point:
        return torch.remainder(a, b)
    # numpy's float mod: the result takes the divisor's sign, zeros included
    r = torch.fmod(a, b)
    r = torch.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    return torch.where(r == 0, torch.copysign(torch.zeros_like(r), b), r)


_WIDE = {torch.uint16: torch.int32, torch.uint32: torch.int64}


@register(M.Pow)
def pow_(n, a, b):
    b = _legacy_broadcast(n, b, a)
    if a.dtype.is_floating_point:
        if not b.dtype.is_floating_point:
            b = b.to(torch.float64 if b.dtype in _UINTS else b.dtype)
        return torch.pow(a, b).to(a.dtype)
    if b.dtype.is_floating_point:
        # int base, float exponent: compute in float64 and truncate like a C cast
        return torch.pow(a.to(torch.float64), b.to(torch.float64)).to(a.dtype)
    wide = _WIDE.get(a.dtype, torch.int64)
    return torch.pow(a.to(wide), b.to(wide)).to(a.dtype)


def _variadic(fn):
    def kernel(n, *xs):
        return functools.reduce(fn, xs)
    return kernel


def _np_reduce(np_fn):
    def kernel(n, *xs):
        return functools.reduce(np_fn, xs)
    return kernel


register(M.Max)(_numpy_fallback(_np_reduce(np.maximum))(unsigned_safe(_variadic(torch.maximum))))
register(M.Min)(_numpy_fallback(_np_reduce(np.minimum))(unsigned_safe(_variadic(torch.minimum))))
register(M.Sum)(unsigned_safe(_variadic(torch.add)))


@register(M.Mean)
def mean(n, *xs):
    total = functools.reduce(torch.add, xs)
    return total / len(xs) if total.dtype.is_floating_point else total // len(xs)


def _np_clip(n, x, lo=None, hi=None):
    if lo is not None and lo.size:
        x = np.maximum(x, lo)
    if hi is not None and hi.size:
        x = np.minimum(x, hi)
    return x


def _clip_bound(n, t, attr: str, default: float, x):
    """Clip bounds are inputs since opset 11 and attributes before; an attribute still at its
    (+-FLT_MAX) default means 'no bound'."""
    if t is not None:
        return t if t.numel() else None
    v = getattr(n.a, attr)
    if v is None or abs(v) == _FLOAT32_MAX and np.sign(v) == np.sign(default):
        return None
    return torch.tensor(v, dtype=x.dtype)


@register(M.Clip)
@_numpy_fallback(_np_clip)
@unsigned_safe
def clip(n, x, lo=None, hi=None):
    lo = _clip_bound(n, lo, "min", -1.0, x)
    hi = _clip_bound(n, hi, "max", 1.0, x)
    if lo is None and hi is None:
        return x
    # min > max gives max everywhere, as ONNX (and numpy.clip) define it
    return torch.clamp(x, lo, hi)


# ---------------------------------------------------------------- unary math

def _unary(torch_fn):
    def kernel(n, x):
        return torch_fn(x)
    return kernel


for _op, _fn in [
    (M.Sqrt, torch.sqrt), (M.Exp, torch.exp), (M.Log, torch.log), (M.Erf, torch.erf),
    (M.Sin, torch.sin), (M.Cos, torch.cos), (M.Tan, torch.tan), (M.Asin, torch.asin),
    (M.Acos, torch.acos), (M.Atan, torch.atan), (M.Sinh, torch.sinh), (M.Cosh, torch.cosh),
    (M.Asinh, torch.asinh), (M.Acosh, torch.acosh), (M.Atanh, torch.atanh),
    (M.Tanh, torch.tanh), (M.Reciprocal, torch.reciprocal),
]:
    register(_op)(_unary(_fn))


def _int_identity(torch_fn):
    # Ceil/Floor/Round of an integer is the integer itself (torch has no int kernels)
    def kernel(n, x):
        return torch_fn(x) if x.dtype.is_floating_point else x
    return kernel


register(M.Ceil)(_int_identity(torch.ceil))
register(M.Floor)(_int_identity(torch.floor))
register(M.Round)(_int_identity(torch.round))  # torch.round is half-to-even, as ONNX wants


@register(M.Neg)
@unsigned_safe
def neg(n, x):
    return torch.neg(x)


@register(M.Abs)
def abs_(n, x):
    return x if x.dtype in _UINTS or x.dtype == torch.uint8 else torch.abs(x)


@register(M.Sign)
def sign(n, x):
    if x.dtype in _UINTS:
        return (x != 0).to(x.dtype)
    return torch.sign(x)


@register(M.IsNaN)
def isnan(n, x):
    return torch.isnan(x)


@register(M.IsInf)
def isinf(n, x):
    pos = torch.isposinf(x) if n.a.detect_positive else torch.zeros_like(x, dtype=torch.bool)
    neg = torch.isneginf(x) if n.a.detect_negative else torch.zeros_like(x, dtype=torch.bool)
    return pos | neg


# ---------------------------------------------------------------- comparisons and logic

def _np_compare(np_fn):
    def kernel(n, a, b):
        if a.dtype == object or b.dtype == object:
            return np.asarray(np_fn(a.astype(object), b.astype(object)), dtype=bool)
        return np_fn(a, b)
    return kernel


for _op, _tfn, _nfn in [
    (M.Equal, torch.eq, operator.eq), (M.Less, torch.lt, operator.lt),
    (M.LessOrEqual, torch.le, operator.le), (M.Greater, torch.gt, operator.gt),
    (M.GreaterOrEqual, torch.ge, operator.ge),
]:
    register(_op)(_numpy_fallback(_np_compare(_nfn))(unsigned_safe(_binary(_tfn))))

register(M.And)(_binary(torch.logical_and))
register(M.Or)(_binary(torch.logical_or))
register(M.Xor)(_binary(torch.logical_xor))
register(M.Not)(_unary(torch.logical_not))

# ---------------------------------------------------------------- bitwise

register(M.BitwiseAnd)(unsigned_safe(_binary(torch.bitwise_and)))
register(M.BitwiseOr)(unsigned_safe(_binary(torch.bitwise_or)))
register(M.BitwiseXor)(unsigned_safe(_binary(torch.bitwise_xor)))
register(M.BitwiseNot)(unsigned_safe(_unary(torch.bitwise_not)))


def _np_bitshift(n, x, y):
    bits = x.dtype.itemsize * 8
    x, y = np.broadcast_arrays(x, y)
    out_of_range = (y < 0) | (y >= bits)
    s = np.where(out_of_range, 0, y).astype(x.dtype)
    if n.a.direction == "LEFT":
        return np.where(out_of_range, 0, x << s).astype(x.dtype)
    fill = (x >> np.asarray(bits - 1, x.dtype)) if x.dtype.kind == "i" else np.zeros_like(x)
    return np.where(out_of_range, fill, x >> s).astype(x.dtype)


_BITS = {torch.uint8: 8, torch.int8: 8, torch.int16: 16, torch.uint16: 16, torch.int32: 32,
         torch.uint32: 32, torch.int64: 64}


@register(M.BitShift)
@_numpy_fallback(_np_bitshift)
def bitshift(n, x, y):
    """Shifts by a negative amount or by at least the bit width give the full-width result
    (0, or -1 for a right shift of a negative value), unlike C and torch, which mask."""
    dt, bits = x.dtype, _BITS[x.dtype]
    wide = _WIDE.get(dt, dt)
    xw, yw = x.to(wide), y.to(wide)
    out_of_range = (yw < 0) | (yw >= bits)
    s = torch.where(out_of_range, torch.zeros_like(yw), yw)
    if n.a.direction == "LEFT":
        r = torch.bitwise_left_shift(xw, s)
        fill = torch.zeros_like(r)
    else:
        r = torch.bitwise_right_shift(xw, s)
        fill = (torch.bitwise_right_shift(xw, bits - 1) if wide == dt and dt != torch.uint8
                else torch.zeros_like(r))
    # narrowing the widened result wraps, which is the defined overflow behaviour
    return torch.where(out_of_range, fill, r).to(dt)


# ---------------------------------------------------------------- selection

def _np_where(n, c, a, b):
    return np.where(c, a, b)


@register(M.Where)
@_numpy_fallback(_np_where)
def where(n, c, a, b):
    if a.dtype in _UINTS:
        wide = _WIDE.get(a.dtype, torch.int64)
        return torch.where(c, a.to(wide), b.to(wide)).to(a.dtype)
    return torch.where(c, a, b)
