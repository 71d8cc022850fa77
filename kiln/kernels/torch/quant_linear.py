"""PyTorch kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
ConvInteger, QLinearMatMul and QLinearConv.

Integer accumulation runs as float32 GEMMs/convolutions over chunks of at most 256 terms of
8-bit products (every partial sum < 2**24, so exact), summed in int32: exact, and much faster
on CPU than torch's integer kernels or float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE, dtype_of
from kiln.kernels.torch.quant import FLOAT8, cast
from kiln.ops import quant as Q

INT_RANGE = {
    DType.uint8: (0, 255), DType.int8: (-128, 127), DType.uint16: (0, 65535),
    DType.int16: (-32768, 32767), DType.uint4: (0, 15), DType.int4: (-8, 7),
    DType.uint2: (0, 3), DType.int2: (-2, 1),
}
_WIDE_INTS = (torch.int32, torch.int64, torch.uint32, torch.uint64)
_EXACT_F32_TERMS = 256  # sums of up to 256 products of 8-bit values stay below 2**24


def widen(v, wide: bool = False) -> torch.Tensor:
    """A quantized value (torch, or numpy for 4/2-bit types) as float32, or float64 when
    ``wide`` or when the value is a 32/64-bit int that float32 would round."""
    if isinstance(v, np.ndarray):
        # as_tensor, not from_numpy: made on the device a CUDA engine runs the kernel under
        return torch.as_tensor(v.astype(np.float64 if wide else np.float32))
    wide = wide or v.dtype in _WIDE_INTS or v.dtype == torch.float64
    return v.to(torch.float64 if wide else torch.float32)


def param(v: torch.Tensor, shape, axis: int, block: int) -> torch.Tensor:
    """Scale / zero point made broadcastable to ``shape``: per tensor, per axis, or blocked
    (each entry repeated ``block`` times along ``axis``, the last block possibly partial)."""
    if v.dim() == 0 or v.numel() == 1:
        return v.reshape(())
    rank = len(shape)
    axis = axis + rank if axis < 0 else axis
    if not block:
        if v.dim() != 1 or not 0 <= axis < rank or v.shape[0] != shape[axis]:
            raise ValueError(f"per-axis parameter of shape {tuple(v.shape)} does not match "
                             f"axis {axis} of input {tuple(shape)}")
        dims = [1] * rank
        dims[axis] = v.shape[0]
        return v.reshape(dims)
    if block < 0:
        raise ValueError("block_size must be positive")
    v = v.repeat_interleave(block, dim=axis).narrow(axis, 0, shape[axis])
    if tuple(v.shape) != tuple(shape):
        raise ValueError(f"blocked parameter does not tile input {tuple(shape)} along {axis}")
    return v


def to_quant(q: torch.Tensor, to: DType):
    """Integer-valued float tensor -> the quantized int dtype (numpy for 4/2-bit types)."""
    tdt = TORCH_DTYPE.get(to)
    if tdt is not None:
        return q.to(tdt)
    return q.to(torch.int8).cpu().numpy().astype(to.np)


@register(Q.QuantizeLinear)
def quantize_linear(n, x, scale, zp=None):
    a = n.a
    zdt = dtype_of(zp) if zp is not None else None
    if zdt is not None and a.output_dtype and DType.from_onnx(a.output_dtype) != zdt:
        raise ValueError(f"QuantizeLinear: output_dtype {DType.from_onnx(a.output_dtype)} "
                         f"!= zero point type {zdt}")
    to = Q.quant_dtype(a, zdt)
    axis, block, shape = a.axis, a.block_size or 0, tuple(x.shape)
    s = param(scale, shape, axis, block)
    if a.precision:
        p = TORCH_DTYPE[DType.from_onnx(a.precision)]
        q = x.to(p) / s.to(p)
    else:
        q = x / s
    if to in INT_RANGE:
        q = torch.round(q)  # half to even, like np.rint
        q = q.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        if zp is not None:
            q = q + param(widen(zp), shape, axis, block)
        return to_quant(q.clamp(*INT_RANGE[to]), to)
    if to in FLOAT8:
        return cast(q, to, bool(a.saturate))
    if to in (DType.float4e2m1, DType.float6e2m3, DType.float6e3m2):
        if zp is not None:
            q = q + param(widen(zp), shape, axis, block)
        return cast(q, to)  # these have no inf/NaN: the conversion saturates by itself
    raise ValueError(f"QuantizeLinear: {to} is not a quantized type")


@register(Q.DequantizeLinear)
def dequantize_linear(n, x, scale, zp=None):
    a = n.a
    src = dtype_of(x)
    axis, block, shape = a.axis, a.block_size or 0, tuple(x.shape)
    xf = widen(x)
    # float8/float4 zero points are zero by definition: only integer ones shift
    if zp is not None and src not in FLOAT8 and src != DType.float4e2m1:
        if dtype_of(zp) != src:
            raise ValueError(f"DequantizeLinear: zero point {dtype_of(zp)} != input {src}")
        xf = xf - param(widen(zp), shape, axis, block)
    y = xf * param(scale, shape, axis, block)
    out = DType.from_onnx(a.output_dtype) if a.output_dtype else dtype_of(scale)
    return y.to(TORCH_DTYPE[out])


@register(Q.DynamicQuantizeLinear)
def dynamic_quantize_linear(n, x):
    xf = x.to(torch.float32)
    # the range always includes 0 so that 0 is exactly representable
    hi = torch.clamp(xf.max(), min=0.0) if xf.numel() else xf.new_zeros(())
    lo = torch.clamp(xf.min(), max=0.0) if xf.numel() else xf.new_zeros(())
    span = torch.where(hi == lo, torch.ones_like(hi), hi - lo)
    scale = span / 255.0
    zp = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    y = torch.clamp(torch.round(xf / scale) + zp, 0.0, 255.0)
    return y.to(torch.uint8), scale.to(x.dtype), zp.to(torch.uint8)


def shifted(v, zp, per_row: bool = False) -> torch.Tensor:
    """``v - zp`` as float. A 1-D zero point of a matmul's A operand is per row (M)."""
    vf = widen(v)
    if zp is None:
        return vf
    z = widen(zp)
    if per_row and z.dim() == 1 and z.numel() > 1 and vf.dim() >= 2:
        z = z.reshape(-1, 1)
    return vf - z


def _exact_dtype(terms: int) -> torch.dtype:
    return torch.float32 if terms <= _EXACT_F32_TERMS else torch.float64


def _chunks(total: int, per: int):
    return [(i, min(per, total - i)) for i in range(0, total, per)] or [(0, 0)]


def int_matmul(a, b, a_zp, b_zp) -> torch.Tensor:
    """(a - a_zp) @ (b - b_zp), exact, as an int32 tensor (float32 GEMMs over K-chunks of
    at most 256, each exact, summed in int32)."""
    af, bf = shifted(a, a_zp, per_row=True), shifted(b, b_zp)
    if bf.dim() == 1:
        return int_matmul_vec(af, bf)
    k = af.shape[-1]
    out = None
    for i, size in _chunks(k, _EXACT_F32_TERMS):
        part = torch.matmul(af.narrow(-1, i, size), bf.narrow(-2, i, size)).to(torch.int32)
        out = part if out is None else out + part
    return out


def int_matmul_vec(af: torch.Tensor, bf: torch.Tensor) -> torch.Tensor:
    return torch.matmul(af.to(torch.float64), bf.to(torch.float64)).to(torch.int32)


@register(Q.MatMulInteger)
def matmul_integer(n, a, b, a_zp=None, b_zp=None):
    return int_matmul(a, b, a_zp, b_zp)


def _requantize(acc: torch.Tensor, mult: torch.Tensor, y_zp, to: DType):
    """acc * mult + y_zp, rounded half to even and saturated to ``to``. float64 throughout,
    as the ONNX reference computes (int32 accumulators times float scales)."""
    r = acc.to(torch.float64) * mult.to(torch.float64)
    if y_zp is not None:
        r = r + widen(y_zp, wide=True)
    lo, hi = INT_RANGE[to]
    return to_quant(torch.round(r).clamp(lo, hi), to)


@register(Q.QLinearMatMul)
def qlinear_matmul(n, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp=None):
    acc = int_matmul(a, b, a_zp, b_zp)
    # the multiplier is formed in the scales' own dtype first, as the reference does
    mult = a_scale * b_scale / y_scale
    to = dtype_of(y_zp) if y_zp is not None else dtype_of(a)
    return _requantize(acc, mult, y_zp, to)


def conv_padding(x_shape, ks, strides, dils, pads, auto_pad: str):
    """(begin, end) pads per spatial dim, resolving SAME_UPPER/SAME_LOWER/VALID."""
    n_sp = len(ks)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(n_sp):
            size = x_shape[2 + i]
            total = max(0, (math.ceil(size / strides[i]) - 1) * strides[i]
                        + (ks[i] - 1) * dils[i] + 1 - size)
            small = total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        return begin, end
    if auto_pad == "VALID":
        return [0] * n_sp, [0] * n_sp
    pads = list(pads or ()) or [0] * (2 * n_sp)
    return pads[:n_sp], pads[n_sp:]


def conv_nd(x: torch.Tensor, w: torch.Tensor, bias, a) -> torch.Tensor:
    """ONNX Conv semantics on float tensors (1-3 spatial dims), zero padding."""
    n_sp = x.dim() - 2
    if n_sp not in (1, 2, 3):
        raise ValueError(f"convolution over {n_sp} spatial dims is not supported")
    ks = list(a.kernel_shape or ()) or list(w.shape[2:])
    strides = list(a.strides or ()) or [1] * n_sp
    dils = list(a.dilations or ()) or [1] * n_sp
    begin, end = conv_padding(tuple(x.shape), ks, strides, dils, a.pads,
                              a.auto_pad or "NOTSET")
    if begin != end:
        flat = []
        for b, e in zip(reversed(begin), reversed(end)):
            flat += [b, e]
        x = F.pad(x, flat)
        begin = [0] * n_sp
    fn = (F.conv1d, F.conv2d, F.conv3d)[n_sp - 1]
    return fn(x, w, bias, strides, begin, dils, a.group or 1)


def _per_channel(v: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-output-channel vector reshaped to broadcast over dim 1 of N,M,spatial."""
    if v.dim() == 1 and v.numel() > 1:
        return v.reshape((1, -1) + (1,) * (rank - 2))
    return v.reshape(())


def int_conv(x, w, x_zp, w_zp, a) -> torch.Tensor:
    """conv(x - x_zp, w - w_zp), exact, as an int32 tensor."""
    xf = shifted(x, x_zp)
    wf = widen(w)
    if w_zp is not None:
        z = widen(w_zp)
        wf = wf - (z.reshape((-1,) + (1,) * (wf.dim() - 1)) if z.numel() > 1 else z.reshape(()))
    per_channel = math.prod(wf.shape[2:])
    groups = a.group or 1
    if groups != 1 or per_channel > _EXACT_F32_TERMS:
        dt = _exact_dtype(math.prod(wf.shape[1:]))
        return conv_nd(xf.to(dt), wf.to(dt), None, a).to(torch.int32)
    # float32 convolutions over input-channel chunks, each exact, summed in int32
    out = None
    for i, size in _chunks(wf.shape[1], max(1, _EXACT_F32_TERMS // per_channel)):
        part = conv_nd(xf.narrow(1, i, size), wf.narrow(1, i, size), None, a).to(torch.int32)
        out = part if out is None else out + part
    return out


@register(Q.ConvInteger)
def conv_integer(n, x, w, x_zp=None, w_zp=None):
    return int_conv(x, w, x_zp, w_zp, n.a)


@register(Q.QLinearConv)
def qlinear_conv(n, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp=None, bias=None):
    acc = int_conv(x, w, x_zp, w_zp, n.a)
    if bias is not None:  # int32 bias: added in float64, where it stays exact
        acc = acc.to(torch.float64) + _per_channel(widen(bias, wide=True), acc.dim())
    mult = x_scale * _per_channel(w_scale, acc.dim()) / y_scale
    to = dtype_of(y_zp) if y_zp is not None else dtype_of(x)
    return _requantize(acc, mult, y_zp, to)

