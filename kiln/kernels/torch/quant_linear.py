"""PyTorch kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
ConvInteger, QLinearMatMul and QLinearConv.

Integer accumulation runs as float32 GEMMs/convolutions, exact because every partial sum
stays within 2**24: the reduction is cut into chunks (summed in int32) so that 255 (the
largest 8-bit code minus its zero point) times each output's sum of |weight - zero point| over
a chunk stays within it. Real weights mostly need one chunk, where a fixed 256 terms of
255 * 255 needed several; the shifted float weight and its chunks are made once per weight
tensor. Exact, and much faster on CPU than torch's integer kernels or float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln import native
from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch.convert import TORCH_DTYPE, dtype_of
from kiln.kernels.torch.quant import FLOAT8, cast
from kiln.ops import int8 as I8
from kiln.ops import quant as Q

INT_RANGE = {
    DType.uint8: (0, 255), DType.int8: (-128, 127), DType.uint16: (0, 65535),
    DType.int16: (-32768, 32767), DType.uint4: (0, 15), DType.int4: (-8, 7),
    DType.uint2: (0, 3), DType.int2: (-2, 1),
}
_WIDE_INTS = (torch.int32, torch.int64, torch.uint32, torch.uint64)
_F32_EXACT = float(2 ** 24)  # every integer up to this magnitude is a float32
_CODE_MAX = 255.0  # |code - zero point| of an 8-bit activation


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
    from kiln import native

    if native.available and x.dtype == torch.float32 and x.device.type == "cpu" and \
            x.is_contiguous() and x.numel():
        return native.dynamic_quantize(x)  # the same steps in one C pass each for range, codes
    xf = x.to(torch.float32)
    # the range always includes 0 so that 0 is exactly representable
    hi = torch.clamp(xf.max(), min=0.0) if xf.numel() else xf.new_zeros(())
    lo = torch.clamp(xf.min(), max=0.0) if xf.numel() else xf.new_zeros(())
    # a constant tensor (no range): scale 1, as onnxruntime gives (the ONNX formula divides 0 by 0)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
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


def exact_chunks(abs_rows: torch.Tensor) -> list[tuple[int, int]]:
    """Cut the reduction into (start, size) chunks such that ``_CODE_MAX`` times the sum of
    ``abs_rows`` [K, outputs] over a chunk stays within 2**24 for every output: then every
    partial sum a float32 GEMM forms over the chunk, in any order, is an exact integer."""
    k, limit = abs_rows.shape[0], _F32_EXACT / _CODE_MAX
    if k == 0 or abs_rows.numel() == 0:
        return [(0, k)]
    if abs_rows.device.type == "cpu":  # the common answers first, in numpy (torch's widening
        # of a [512, 2048] integer weight to float64 alone took 10+ ms at a first run)
        a = abs_rows.reshape(k, -1).numpy()
        if float(a.max()) > limit:  # one row alone could round: only float64 is exact
            return []
        if float(a.sum(0, dtype=np.float64).max()) <= limit:  # the whole reduction: one chunk
            return [(0, k)]
    rows = abs_rows.to(torch.float64).reshape(k, -1)
    if float(rows.max()) > limit:
        return []
    cum = torch.cat([rows.new_zeros((1, rows.shape[1])), rows.cumsum(0)])
    out, start = [], 0
    while start < k:
        reach = (cum[start + 1:] - cum[start]).amax(1)
        size = int(torch.searchsorted(reach, torch.tensor([limit], dtype=reach.dtype),
                                      right=True)[0])
        out.append((start, size))
        start += size
    return out


def _prepared(cache: dict | None, key: str, tensors: tuple, make):
    """``make()`` once per set of input tensors: the same objects, not written since (torch's
    version counter), as a constant weight is; an activation made again each call. A tensor made
    under inference mode (an activation of the running program, e.g. attention's second
    QLinearMatMul operand) has no version counter: nothing made from it is kept."""
    if cache is None or any(torch.is_tensor(t) and t.is_inference() for t in tensors):
        return make()
    versions = tuple(getattr(t, "_version", None) for t in tensors)
    got = cache.get(key)
    if got is None or len(got[0]) != len(tensors) or got[1] != versions or any(
            a is not b for a, b in zip(got[0], tensors)):
        got = cache[key] = (tensors, versions, make())
    return got[2]


def _matmul_weight(b, b_zp):
    """(b - b_zp as float32, its exact chunks along K ([] when only float64 is exact), and
    :func:`_u8_split`'s packed pieces or None)."""
    bf = shifted(b, b_zp).to(torch.float32)
    chunks = exact_chunks(bf.abs().movedim(-2, 0).reshape(bf.shape[-2], -1))
    # FBGEMM's pieces are CPU tensors: on CUDA (the weight on the device) the float chunks
    split = bf.dim() == 2 and len(chunks) == 1 and bf.device.type == "cpu"
    return bf, chunks, _u8_split(bf) if split else None


def _u8_split(bf: torch.Tensor):
    """A 2-D weight of integers in [-255, 255] as FBGEMM int8 pieces ``l + 128 h`` with
    ``|l| <= 64`` and ``|h| <= 2``: u8 x s8 int16 pair sums cannot saturate on either
    (255 * 64 * 2 < 32767), so two u8s8 GEMMs (a third of the float32 weight's bytes) give
    the exact integers. None without FBGEMM, or when a piece's sums could pass 2**24."""
    from kiln.kernels.torch import int8 as K

    if not K._HAS_FBGEMM or bf.abs().max() > 255:
        return None
    h = torch.round(bf / 128)
    low = bf - 128 * h
    limit = _F32_EXACT / _CODE_MAX
    if float(low.abs().sum(0).max()) > limit:
        return None
    ones = torch.ones(bf.shape[1])
    packs = [K._fbgemm_pack(low.to(torch.int8), ones, None)]
    if bool(h.any()):
        packs.append(K._fbgemm_pack(h.to(torch.int8), ones, None))
    return packs


def _int_matmul_u8_split(af: torch.Tensor, a_zp, packs) -> torch.Tensor:
    """(codes - zp) @ W by :func:`_u8_split`'s pieces: FBGEMM is given the shifted codes
    with scale 1 and the zero point, so it quantizes them back to the codes exactly, and its
    float results are integers below 2**24 (exact)."""
    k = af.shape[-1]
    x2 = af.reshape(-1, k).contiguous()
    z = int(a_zp) if a_zp is not None else 0
    lin = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    y = lin(x2, 1.0, z, packs[0])
    if len(packs) > 1:
        y = y.add_(lin(x2, 1.0, z, packs[1]), alpha=128)
    return y.to(torch.int32).reshape(*af.shape[:-1], y.shape[-1])


def _qgemm_weight(b, b_zp):
    """kiln's qgemm form of a constant 2-D weight, or None: (QGemmWeight of int8 codes w,
    int32 column offsets c or None) with ``b - b_zp = w + c``. uint8 codes beyond int8 after
    their zero point are shifted by 128 (c = 128 - b_zp). None where qgemm's exact sums would
    not be onnxruntime's: int8 weights beyond the 7-bit grid on a CPU whose u8s8 GEMMs
    saturate int16 pairs (onnxruntime's u8 x u8 GEMM is exact everywhere). The codes are
    worked on in numpy (torch's 8-bit elementwise ops with a scalar and its int8 sums ran
    20-80 ms on a [1024, 8210] weight, numpy's 0.3-2: this runs at a model's first run)."""
    from kiln import native
    from kiln.kernels.torch import int8 as K

    if not native.available or b.dim() != 2 or b.device.type != "cpu" or \
            b.dtype not in (torch.int8, torch.uint8) or b.numel() == 0:
        return None
    if b_zp is not None and (b_zp.dim() > 1 or b_zp.numel() not in (1, b.shape[1])):
        return None
    bn = b.contiguous().numpy()
    z = np.zeros(1, dtype=np.int16) if b_zp is None else \
        b_zp.reshape(-1).numpy().astype(np.int16)
    if z.size == 1:  # the range of b - z from b's own
        lo, hi = int(bn.min()) - int(z[0]), int(bn.max()) - int(z[0])
    else:
        lo, hi = int((bn.min(0) - z).min()), int((bn.max(0) - z).max())
    if b.dtype == torch.int8 and K.u8s8_saturates() and max(-lo, hi) > 63:
        return None
    if lo >= -128 and hi <= 127:
        codes = (bn.astype(np.int16) - z).astype(np.int8)
        return native.QGemmWeight(torch.from_numpy(codes)), None
    if b.dtype != torch.uint8:
        return None
    off = torch.from_numpy(128 - z.astype(np.int32)).expand(b.shape[1]).contiguous()
    return native.QGemmWeight(torch.from_numpy((bn ^ np.uint8(128)).view(np.int8))), off


def _int_matmul_qgemm(a: torch.Tensor, a_zp, got) -> torch.Tensor:
    """(a - a_zp) @ (w + c) by qgemm: the int32 sums of w, plus the rows' code sums times c."""
    from kiln import native

    w, off = got
    k = a.shape[-1]
    a2 = a.reshape(-1, k)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    z = 0 if a_zp is None else int(a_zp.reshape(()))
    y = native.qgemm_int32(a2, z, w)
    if off is not None:
        rows = a2.sum(1, dtype=torch.int32) - k * z
        y.add_(rows[:, None] * off[None, :])
    return y.reshape(*a.shape[:-1], w.n)


def int_matmul(a, b, a_zp, b_zp, cache: dict | None = None) -> torch.Tensor:
    """(a - a_zp) @ (b - b_zp), exact, as an int32 tensor: kiln's qgemm for uint8 codes by a
    constant 8-bit weight on the CPU (:func:`_qgemm_weight`), else float32 GEMMs over K-chunks
    that cannot round (see :func:`exact_chunks`), summed in int32. ``cache``: a node's cache,
    to keep the shifted weight of a constant ``b``."""
    if cache is not None and a.dtype == torch.uint8 and a.device.type == "cpu" and \
            a.dim() >= 2 and np.ndim(b) == 2 and (a_zp is None or a_zp.numel() == 1):
        got = _prepared(cache, "int_matmul_qgemm", (b, b_zp), lambda: _qgemm_weight(b, b_zp))
        if got is not None:
            return _int_matmul_qgemm(a, a_zp, got)
    af = shifted(a, a_zp, per_row=True)
    if np.ndim(b) == 1:
        return int_matmul_vec(af, shifted(b, b_zp))
    bf, chunks, split = _prepared(cache, "int_matmul_w", (b, b_zp),
                                  lambda: _matmul_weight(b, b_zp))
    if split is not None and a.dtype == torch.uint8 and a.device.type == "cpu" and (
            a_zp is None or a_zp.numel() == 1):
        return _int_matmul_u8_split(af.to(torch.float32), a_zp, split)
    if not chunks:
        return torch.matmul(af.double(), bf.double()).to(torch.int32)
    af = af.to(torch.float32)
    out = None
    for i, size in chunks:
        x = af if size == af.shape[-1] else af.narrow(-1, i, size)
        w = bf if size == bf.shape[-2] else bf.narrow(-2, i, size)
        part = torch.matmul(x, w).to(torch.int32)
        out = part if out is None else out + part
    return out


def int_matmul_vec(af: torch.Tensor, bf: torch.Tensor) -> torch.Tensor:
    return torch.matmul(af.to(torch.float64), bf.to(torch.float64)).to(torch.int32)


@register(Q.MatMulInteger)
def matmul_integer(n, a, b, a_zp=None, b_zp=None):
    return int_matmul(a, b, a_zp, b_zp, n.cache)


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
    acc = int_matmul(a, b, a_zp, b_zp, n.cache)
    # the multiplier is formed in the scales' own dtype first, as the reference does
    mult = a_scale * b_scale / y_scale
    to = dtype_of(y_zp) if y_zp is not None else dtype_of(a)
    return _requantize(acc, mult, y_zp, to)


@register(Q.QGemm)
def qgemm(n, a, a_scale, a_zp, b, b_scale, b_zp, c=None, y_scale=None, y_zp=None):
    """onnxruntime's QGemm: ``acc = C + (A - a_zero) @ (B - b_zero)`` exact in int32, times
    ``alpha * a_scale * b_scale`` (per column where b_scale is) in float32, as its MLAS output
    processors compute; then divided by y_scale, rounded half to even, shifted by y_zero and
    saturated to y_zero's type, or left as float32 without y_zero_point."""
    at = n.attrs
    if at.transA:
        a = a.t()
    if at.transB:  # a constant weight: transposed once, so the packed form is kept too
        b = _prepared(n.cache, "qgemm_bt", (b,), lambda: b.t().contiguous())
    acc = int_matmul(a, b, a_zp, b_zp, n.cache)
    if c is not None:
        acc = acc + c.to(torch.int32)
    scale = (torch.as_tensor(at.alpha if at.alpha is not None else 1.0, dtype=torch.float32)
             * a_scale.float().reshape(()) * b_scale.float().reshape(-1))
    if y_zp is None:
        if y_scale is not None:
            scale = scale / y_scale.float().reshape(())
        return acc.to(torch.float32) * scale
    scale = scale / y_scale.float().reshape(())
    to = dtype_of(y_zp)
    lo, hi = INT_RANGE[to]
    r = torch.round(acc.to(torch.float32) * scale) + y_zp.to(torch.float32).reshape(())
    return to_quant(r.clamp(lo, hi), to)


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


def _conv_weight(w, w_zp):
    """(w - w_zp as float32 [M, C/group, k...], exact chunks over its input channels)."""
    wf = widen(w)
    if w_zp is not None:
        z = widen(w_zp)
        wf = wf - (z.reshape((-1,) + (1,) * (wf.dim() - 1)) if z.numel() > 1 else z.reshape(()))
    wf = wf.to(torch.float32)
    per_input = wf.abs().reshape(wf.shape[0], wf.shape[1], -1).sum(2).t()  # [C/group, M]
    return wf, exact_chunks(per_input)


def _qconv_weight(w, w_zp):
    """A constant 8-bit weight with one zero point (or one per output channel, all equal: a
    per-channel int8 weight's zeros) as qconv.c's (2-D: a 1-D kernel gets a height of 1),
    else None."""
    if not torch.is_tensor(w) or w.dtype not in (torch.uint8, torch.int8) or \
            w.dim() not in (3, 4):
        return None
    if w_zp is not None and w_zp.numel() != 1:
        if w_zp.numel() != w.shape[0] or bool((w_zp.reshape(-1) != w_zp.reshape(-1)[0]).any()):
            return None
        w_zp = w_zp.reshape(-1)[:1]
    w4 = w if w.dim() == 4 else w.unsqueeze(2)
    return native.QConvWeight(w4, 0 if w_zp is None else int(w_zp.reshape(()).item()))


def qconv_plan(x, w, w_zp, a, cache):
    """kiln's VNNI integer convolution planned for this layer and x's shape and dtype (a
    :class:`kiln.native.QConvPlan`, kept in ``cache`` per shape), or None where it cannot take
    the layer: 8-bit CPU codes, a constant weight with one zero point, one group, 1-2 spatial
    dims."""
    if not torch.is_tensor(x) or x.device.type != "cpu":
        return None
    return qconv_plan_for(tuple(x.shape), x.dtype, w, w_zp, a, cache)


def qconv_plan_for(shape: tuple, dtype, w, w_zp, a, cache):
    """:func:`qconv_plan` for codes of ``shape`` and ``dtype`` (a program planner's traced
    value)."""
    if cache is None or (a.group or 1) != 1 or dtype not in (torch.uint8, torch.int8) or \
            len(shape) not in (3, 4) or len(shape) != np.ndim(w) or \
            not native.qconv_available():
        return None
    qw = _prepared(cache, "qconv_w", (w, w_zp), lambda: _qconv_weight(w, w_zp))
    if qw is None:
        return None
    plans = cache.setdefault("qconv_plans", {})
    key = (shape, dtype, id(qw))
    plan = plans.get(key)
    if plan is None or plan.w is not qw:
        n_sp = len(shape) - 2
        ks = list(a.kernel_shape or ()) or list(w.shape[2:])
        strides = list(a.strides or ()) or [1] * n_sp
        dils = list(a.dilations or ()) or [1] * n_sp
        begin, end = conv_padding(shape, ks, strides, dils, a.pads, a.auto_pad or "NOTSET")
        shape4 = shape
        if n_sp == 1:
            shape4, strides, dils = (shape[0], shape[1], 1, shape[2]), [1, *strides], [1, *dils]
            begin, end = [0, *begin], [0, *end]
        plan = plans[key] = native.QConvPlan(shape4, dtype, qw, strides, [*begin, *end], dils)
    return plan


def _qconv(x, w, x_zp, w_zp, a, cache, bias=None, scale=0.0):
    if x_zp is not None and x_zp.numel() != 1:
        return None
    plan = qconv_plan(x, w, w_zp, a, cache)
    if plan is None:
        return None
    xz = 0 if x_zp is None else int(x_zp.reshape(()).item())
    y = plan.run(x if x.dim() == 4 else x.unsqueeze(2), xz, bias, scale)
    return y.squeeze(2) if x.dim() == 3 else y


def int_conv(x, w, x_zp, w_zp, a, cache: dict | None = None) -> torch.Tensor:
    """conv(x - x_zp, w - w_zp), exact, as an int32 tensor: kiln's VNNI integer convolution
    where it takes the layer (:func:`qconv_args`), else float32 convolutions over
    input-channel chunks that cannot round (:func:`exact_chunks`), summed in int32; a grouped
    convolution in one piece (float64 when one float32 piece could round)."""
    y = _qconv(x, w, x_zp, w_zp, a, cache)
    if y is not None:
        return y
    xf = shifted(x, x_zp).to(torch.float32)
    wf, chunks = _prepared(cache, "int_conv_w", (w, w_zp), lambda: _conv_weight(w, w_zp))
    groups = a.group or 1
    if not chunks or (groups != 1 and len(chunks) > 1):
        return conv_nd(xf.double(), wf.double(), None, a).to(torch.int32)
    if groups != 1:
        return conv_nd(xf, wf, None, a).to(torch.int32)
    out = None
    for i, size in chunks:
        xs = xf if size == xf.shape[1] else xf.narrow(1, i, size)
        ws = wf if size == wf.shape[1] else wf.narrow(1, i, size)
        part = conv_nd(xs, ws, None, a).to(torch.int32)
        out = part if out is None else out + part
    return out


@register(Q.ConvInteger)
def conv_integer(n, x, w, x_zp=None, w_zp=None):
    return int_conv(x, w, x_zp, w_zp, n.a, n.cache)


@register(I8.ConvIntegerScaled)
def conv_integer_scaled(n, x, w, x_zp, w_zp, b, s):
    """ConvInteger, then the ops it replaces one after the other, each in its own dtype: the
    bias ``int32(floor(B / S))`` added in int32, the sum cast to float32 and scaled by S
    (in one qconv.c call where it takes the layer)."""
    if torch.is_tensor(s) and s.numel() == 1 and torch.is_tensor(b) and s.device.type == "cpu":
        sf = float(s.float().reshape(()).item())
        if sf != 0.0 and math.isfinite(sf):
            bf = _conv_bias(n, b)
            y = _qconv(x, w, x_zp, w_zp, n.a, n.cache, bf, sf) if bf.numel() == \
                w.shape[0] else None
            if y is not None:
                return y
    acc = int_conv(x, w, x_zp, w_zp, n.a, n.cache)
    bq = torch.floor(torch.div(b.float(), s.float())).to(torch.int32)
    acc = acc.add_(bq.reshape((1, -1) + (1,) * (acc.dim() - 2)))
    return acc.to(torch.float32).mul_(s.float().reshape(()))


def _conv_bias(n, b):
    return _prepared(n.cache, "qconv_b", (b,), lambda: b.float().reshape(-1).contiguous())


@register(I8.DynamicConvInteger)
def dynamic_conv_integer(n, x, w, w_zp, b, ws):
    """DynamicQuantizeLinear and ConvIntegerScaled in one qconv.c call (kiln_dq_qconv) where
    qconv takes the layer (AVX512-VNNI); elsewhere the two kernels one after the other (the
    codes by kiln's C DynamicQuantizeLinear, the convolution in exact float32 chunks), with
    ``S = x_scale * w_scale`` in float32 either way."""
    wsf = ws.float().reshape(())
    if x.dtype == torch.float32 and x.device.type == "cpu" and torch.is_tensor(b) and \
            b.numel() == w.shape[0]:
        plan = qconv_plan_for(tuple(x.shape), torch.uint8, w, w_zp, n.a, n.cache)
        if plan is not None:
            y = plan.run_dynamic(x if x.dim() == 4 else x.unsqueeze(2), _conv_bias(n, b),
                                 float(wsf))
            return y.squeeze(2) if x.dim() == 3 else y
    xq, xs, xz = dynamic_quantize_linear(n, x.contiguous())
    return conv_integer_scaled(n, xq, w, xz, w_zp, b, xs.float().reshape(()) * wsf)


@register(Q.QLinearConv)
def qlinear_conv(n, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp=None, bias=None):
    acc = int_conv(x, w, x_zp, w_zp, n.a, n.cache)
    if bias is not None:  # int32 bias: added in float64, where it stays exact
        acc = acc.to(torch.float64) + _per_channel(widen(bias, wide=True), acc.dim())
    mult = x_scale * _per_channel(w_scale, acc.dim()) / y_scale
    to = dtype_of(y_zp) if y_zp is not None else dtype_of(x)
    return _requantize(acc, mult, y_zp, to)



@register(I8.DynamicMatMulInteger)
def dynamic_matmul_integer(n, x, w, w_zp, ws, bias=None):
    """One qgemm.c call where it takes the weight (kiln_qgemm_f32_off: x's codes by its own
    range, the exact products, ``float32(acc) * (x_scale * w_scale) + bias`` in its epilogue);
    elsewhere kiln's DynamicQuantizeLinear and MatMulInteger kernels, then those float32
    steps in torch."""
    from kiln import native

    got = _dyn_qgemm(n, w, w_zp) if x.device.type == "cpu" and x.dtype == torch.float32 and \
        x.dim() >= 2 else None
    if got is not None:
        qw, off = got
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        wsf = _prepared(n.cache, "dyn_mm_ws", (ws,), lambda: ws.float().reshape(-1).contiguous())
        bf = None if bias is None else _prepared(
            n.cache, "dyn_mm_b", (bias,), lambda: bias.float().reshape(-1).contiguous())
        y = native.qgemm_f32(x2, 0.0, 0, qw, wsf, bf, col_off=off)
        return y.reshape(*x.shape[:-1], qw.n)
    xq, xs, xz = dynamic_quantize_linear(n, x.contiguous())
    acc = int_matmul(xq, w, xz, w_zp, n.cache)
    y = acc.to(torch.float32).mul_(xs.float().reshape(()) * ws.float())
    return y if bias is None else y.add_(bias.float())


def _dyn_qgemm(n, w, w_zp):
    """(QGemmWeight, its one column offset) for :func:`dynamic_matmul_integer`'s qgemm call,
    or None (no C library, a weight qgemm does not take, a column offset that differs per
    column)."""
    from kiln import native

    if not native.available or not torch.is_tensor(w) or w.dim() != 2:
        return None
    got = _prepared(n.cache, "int_matmul_qgemm", (w, w_zp), lambda: _qgemm_weight(w, w_zp))
    if got is None:
        return None
    qw, off = got
    if off is None:
        return qw, 0
    if bool((off != off[0]).any()):
        return None
    return qw, int(off[0])
