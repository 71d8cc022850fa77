"""PyTorch kernels: Int8MatMul and Int8Conv (kiln.ops.int8).

On the CPU, Int8MatMul runs FBGEMM's u8s8 GEMM through PyTorch
(``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``): the activation is quantized to
uint8 codes while FBGEMM packs it (no separate quantize pass), the products accumulate in int32
(pairs of u8 x s8 products summed in int16 first, saturating, as onnxruntime's MLAS does on
AVX2: the two give the same integers), and dequantize + bias run in its epilogue; residual and
activation follow in place. Where FBGEMM is missing, oneDNN's ``onednn::qlinear_pointwise``
runs it (quantize first, post-ops in oneDNN). Int8Conv runs oneDNN's
``onednn::qconv2d_pointwise``. Weights are packed on the first call and kept. Elsewhere (CUDA,
or a PyTorch without these ops) the same arithmetic is emulated in float: exact integer codes,
products summed in float32.
"""

from __future__ import annotations

import os
import struct
import threading

import torch

from kiln.kernels.registry import register
from kiln.kernels.torch.fused_conv import (
    _AFTER_ONEDNN,
    _ONEDNN_ACT,
    _TORCH_ACT,
    FOREIGN_TACTICS,
    epilogue,
    symmetric_geometry,
)
from kiln.ops import int8 as I8

_HAS_ONEDNN = hasattr(torch.ops.onednn, "qlinear_pointwise") and \
    torch.backends.mkldnn.is_available()
_HAS_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
    torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")
_LOCK = threading.Lock()
_FORCED = os.environ.get("KILN_CPU_INT8", "")  # fbgemm | onednn | qgemm: no timing (benchmarks)


def u8s8_saturates() -> bool:
    """Whether this CPU's u8 x s8 GEMMs (onnxruntime's MLAS and FBGEMM alike) add pairs of
    products in int16 with saturation: x86 with AVX2 but without AVX512-VNNI (vpmaddubsw).
    With VNNI (vpdpbusd) both accumulate in int32 exactly. (A CPU with AVX-VNNI alone, where
    MLAS is exact and FBGEMM is not, reads as saturating.)"""
    global _SATURATES
    if _SATURATES is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "").split()
        except OSError:
            flags = []
        _SATURATES = "avx512_vnni" not in flags
    return _SATURATES


_SATURATES: bool | None = None


def quantize_u8(x: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
    """uint8 codes ``clamp(round(x / scale) + zero, 0, 255)`` (round half to even)."""
    y = torch.div(x, scale)
    return y.round_().add_(zero).clamp_(0, 255).to(torch.uint8)


def quantize_u8_fast(x: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
    """:func:`quantize_u8` by PyTorch's vectorised quantizer (2-3x faster on the CPU): it
    multiplies by ``1 / scale``, which can round the other way where ``x / scale`` is within
    an ulp of a half (a few codes in a million)."""
    import warnings

    if x.dtype != torch.float32:
        return quantize_u8(x, scale, zero)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(x, scale, zero, torch.quint8).int_repr()


def _onednn(x: torch.Tensor) -> bool:
    return _HAS_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32


def _cpu_half(x: torch.Tensor) -> bool:
    """An FP16/BF16 build's INT8 layer on the CPU: oneDNN in float32, cast back."""
    return _HAS_ONEDNN and x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16)


def _cached(n, key, make):
    """A per-node value made once (the packed weight)."""
    v = n.cache.get(key)
    if v is None:
        with _LOCK:
            v = n.cache.get(key)
            if v is None:
                v = n.cache[key] = make()
    return v


def _post_op(a, r):
    """oneDNN's post-op for the epilogue, when it can run there (no residual)."""
    if r is None and a.activation not in _AFTER_ONEDNN:
        attr, scalars, algo = _ONEDNN_ACT[a.activation]
        return attr, scalars(a), algo, False
    return "none", [], "", True


def dynamic_range(x: torch.Tensor) -> tuple[float, int]:
    """(scale, uint8 zero) from x's own range, which always holds 0, in float32 arithmetic as
    onnxruntime's DynamicQuantizeLinear computes them (``(max - min) / 255``; zero point
    ``round(-min / scale)``, half to even)."""
    lo, hi = torch.aminmax(x)
    lo, hi = min(lo.item(), 0.0), max(hi.item(), 0.0)  # float32 values, exact as floats
    if not hi > lo:
        return 1.0, 0
    scale = _f32(_f32(hi - lo) / 255.0)
    zero = min(max(-_f32(lo / scale), 0.0), 255.0)
    return scale, int(round(zero))  # Python rounds half to even, as std::nearbyint


def _dynamic_input(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """(x as its dynamic codes dequantize it, scale, zero). FBGEMM quantizes its float input
    itself as ``x * (1 / scale) + zero`` (a fused multiply-add), whose rounding differs from
    DynamicQuantizeLinear's ``round(x / scale) + zero`` at a few codes per tensor, each of
    which moves a row of the output (by 1e-4 of BERT's hidden state) and every later dynamic
    range: given ``(codes - zero) * scale`` it gets back exactly the codes onnxruntime
    computes (within 3e-5 of an integer, never near a half)."""
    from kiln import native

    if native.available and x.dtype == torch.float32 and x.device.type == "cpu" and \
            x.is_contiguous() and x.numel():
        return native.dynamic_qdq(x)
    s, z = dynamic_range(x)
    return x, s, z


def _f32(v: float) -> float:
    """``v`` rounded to float32 (a float32 operation's result on float32 operands)."""
    return struct.unpack("f", struct.pack("f", v))[0]


class _Over:
    """Attributes ``a`` with some overridden (cheaper than ``dataclasses.replace``, which a
    dynamic layer would pay on every call)."""

    def __init__(self, a, **kw):
        self._a = a
        self.__dict__.update(kw)

    def __getattr__(self, name):
        return getattr(self._a, name)


def _fbgemm_ok(x: torch.Tensor) -> bool:
    return _HAS_FBGEMM and x.device.type == "cpu" and x.dtype == torch.float32


def _fbgemm_pack(wq: torch.Tensor, w_scale: torch.Tensor, b):
    """FBGEMM's packed weight ([N, K] int8 codes per output channel, the float bias)."""
    import warnings

    m = wq.shape[1]
    scale = w_scale.reshape(-1).double()
    if scale.numel() == 1:
        scale = scale.expand(m).contiguous()
    with warnings.catch_warnings():  # the quantized-tensor constructors warn of deprecation
        warnings.simplefilter("ignore")
        w = torch._make_per_channel_quantized_tensor(
            wq.t().contiguous(), scale, torch.zeros(m, dtype=torch.long), 0)
        engine = torch.backends.quantized.engine
        try:  # the prepack dispatches on the global engine: FBGEMM for this one call
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(
                w, None if b is None else b.float().contiguous())
        finally:
            torch.backends.quantized.engine = engine


def _int8_matmul_fbgemm(n, a, x, wq, w_scale, b, r):
    k, m = wq.shape
    packed = _cached(n, "w_fbgemm", lambda: _fbgemm_pack(wq, w_scale, b))
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x2, a.x_scale, a.x_zero, packed)
    y = y.reshape(*x.shape[:-1], m)
    return _native_epilogue(y, a, r)


def _native_epilogue(y, a, r):
    """``act(y + r)`` in place; the activation by kiln's vectorised C kernel where it has
    it (GELU by torch costs a third of an INT8 GEMM's time at BERT's FC1 shapes)."""
    from kiln import native

    act = a.activation or ""
    if not act or not native.available or act not in native.POINTWISE or \
            not y.is_contiguous():
        return epilogue(y, a, r)
    if r is not None:
        y = epilogue(y, _Over(a, activation=""), r)
    return native.pointwise(act, y, p0=a.alpha, p1=a.beta, out=y)


@register(I8.Int8MatMul)
def int8_matmul(n, x, wq, w_scale, b=None, r=None):
    a = n.a
    if handoff(a, x):
        return _int8_matmul_emulated(n, x, wq, w_scale, b, r)
    if _cpu_half(x):
        b, r = (None if t is None else t.float() for t in (b, r))
        return int8_matmul(n, x.float(), wq, w_scale, b, r).to(x.dtype)
    if not _onednn(x) and not _fbgemm_ok(x) and not _qgemm_ok(n, x, wq):
        if a.x_scale == 0.0:  # dynamic: this call's own range
            x, s, z = _dynamic_input(x)
            n = _WithAttrs(n, _Over(a, x_scale=s, x_zero=z))
        return _int8_matmul_emulated(n, x, wq, w_scale, b, r)
    return _TACTICS[_tactic(n, x, wq, w_scale, b, r)](n, x, wq, w_scale, b, r)


def _qgemm_ok(n, x, wq) -> bool:
    """Can kiln's u8 x s8 GEMM (qgemm.c) run this layer and compute onnxruntime's integers? It
    sums exactly, as onnxruntime does with AVX512-VNNI; on a CPU whose u8s8 GEMMs saturate
    int16 pair sums it takes only weights on kiln's 7-bit grid, where nothing saturates."""
    from kiln import native

    if not (native.available and x.device.type == "cpu" and x.dtype == torch.float32 and
            wq.dtype == torch.int8 and wq.dim() == 2 and x.dim() >= 2 and
            getattr(n.a, "activation", "") in native.ACTIVATIONS):
        return False
    return not u8s8_saturates() or not _cached(n, "w_full_range",
                                               lambda: bool(wq.abs().max() > 63))


def _with_input(fn):
    """``fn(n, a, x, ...)`` of a float input, a dynamic layer's quantized by its own range."""
    def run(n, x, wq, w_scale, b, r):
        a = n.a
        if a.x_scale == 0.0:  # dynamic: this call's own range
            x, s, z = _dynamic_input(x)
            a = _Over(a, x_scale=s, x_zero=z)
            n = _WithAttrs(n, a)
        return fn(n, a, x, wq, w_scale, b, r)
    return run


def _int8_matmul_qgemm(n, x, wq, w_scale, b, r):
    """qgemm.c: the input quantized in C (by x_scale/x_zero, or a dynamic layer's own range:
    DynamicQuantizeLinear's codes), exact int32 products, dequantize + bias + residual +
    activation in its epilogue."""
    from kiln import native

    a = n.a
    k, m = wq.shape
    w = _cached(n, "w_qgemm", lambda: native.QGemmWeight(wq))
    ws = _cached(n, "w_scale_qgemm", lambda: w_scale.float().reshape(-1).contiguous())
    bias = None if b is None else _cached(n, "b_qgemm", lambda: b.float().contiguous())
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    shape = (*x.shape[:-1], m)
    r2 = None
    if r is not None and tuple(r.shape) == shape and r.dtype == torch.float32:
        r2 = r.reshape(-1, m)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    act = a.activation if r is None or r2 is not None else ""
    y = native.qgemm_f32(x2, a.x_scale, a.x_zero, w, ws, bias, r2, act, a.alpha, a.beta)
    y = y.reshape(shape)
    return y if r is None or r2 is not None else epilogue(y, a, r)


_TACTICS = {}  # filled below: name -> fn(n, x, wq, w_scale, b, r)


def _tactic(n, x, wq, w_scale, b, r) -> str:
    """FBGEMM, oneDNN or kiln's qgemm for this node and input shape: the fastest of those that
    can run it, timed on the first call (best of 3 each), kept in ``n.cache["lin_tactics"]``.
    Weights beyond kiln's 7-bit grid (an onnxruntime-quantized model's own codes) take FBGEMM
    or qgemm: FBGEMM's saturating int16 pair sums are the ones onnxruntime computes without
    AVX512-VNNI, where qgemm (exact) is left out; with it, both are exact, as onnxruntime
    is. ``KILN_CPU_INT8`` (fbgemm | onednn | qgemm) forces one where it can run."""
    picks = n.cache.get("lin_tactics")
    key = tuple(x.shape)
    if picks is not None and key in picks:
        return picks[key]
    full = _cached(n, "w_full_range", lambda: bool(wq.abs().max() > 63))
    can = [name for name, ok in (("fbgemm", _fbgemm_ok(x)),
                                 ("onednn", _onednn(x) and not full),
                                 ("qgemm", _qgemm_ok(n, x, wq))) if ok]
    if not can:  # full-range weights where neither exact path runs: oneDNN, as before
        can = ["onednn"]
    return _pick(n, key, can, lambda name: _TACTICS[name](n, x, wq, w_scale, b, r),
                 ("linear", key, tuple(wq.shape), str(wq.dtype), b is not None,
                  getattr(n.a, "activation", ""), None if r is None else tuple(r.shape),
                  getattr(n.a, "x_scale", None) == 0.0))


def _pick(n, key, can: list, run, sig: tuple = ()) -> str:
    """The tactic of ``can`` for input shape ``key``: ``KILN_CPU_INT8``'s where it is one of
    them, else the fastest of ``run(name)`` (best of 3 each), kept in n.cache["lin_tactics"].
    A timed pick is also the process's for the layer signature ``sig`` (shapes, epilogue,
    the candidates, threads) in fused_conv's table of CPU picks, which a build records into
    the engine file and a load preloads: a loaded engine's first run then times (and packs
    the losers' weights for) nothing."""
    from kiln.kernels.torch import fused_conv as FCK

    full = ("int8", *sig, tuple(can), torch.get_num_threads()) if sig else None
    if _FORCED in can:
        name = _FORCED
    elif len(can) == 1:
        name = can[0]
    else:
        with FCK._choices_lock:
            name = FCK._choices.get(full) if full else None
        if name not in can:
            import time

            best = {}
            for _ in range(3):
                for name in can:
                    t0 = time.perf_counter()
                    run(name)
                    best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
            name = min(best, key=best.get)
        if full:
            with FCK._choices_lock:
                FCK._choices[full] = name
                FCK._note(full, name)
    with _LOCK:
        n.cache.setdefault("lin_tactics", {})[key] = name
    return name


def _int8_matmul_onednn(n, a, x, wq, w_scale, b, r):
    k, m = wq.shape
    x2 = x.reshape(-1, k)
    packed = _cached(n, "w_packed", lambda: torch.ops.onednn.qlinear_prepack(
        wq.t().contiguous(), None))
    zeros = _cached(n, "w_zero", lambda: torch.zeros(m, dtype=torch.long))
    attr, scalars, algo, after = _post_op(a, r)
    y = torch.ops.onednn.qlinear_pointwise(
        quantize_u8_fast(x2, a.x_scale, a.x_zero), a.x_scale, a.x_zero, packed, w_scale, zeros, b,
        1.0, 0, torch.float32, attr, scalars, algo)
    y = y.reshape(*x.shape[:-1], m)
    return epilogue(y, a, r) if after else y


_TACTICS.update(fbgemm=_with_input(_int8_matmul_fbgemm),
                onednn=_with_input(_int8_matmul_onednn), qgemm=_int8_matmul_qgemm)
FOREIGN_TACTICS["int8"] = frozenset(_TACTICS)  # the picks an engine file may carry


@register(I8.Int8MatMulQDQ)
def int8_matmul_qdq(n, x, wq, w_scale):
    """FBGEMM's products requantized by kiln (:func:`_qdq_fbgemm`) or kiln's qgemm with the
    requantization in its epilogue (:func:`_qdq_qgemm`), the faster at this shape where both
    compute onnxruntime's integers (timed on the first call, as :func:`_tactic`)."""
    if x.dtype == torch.float32 and _qgemm_ok(n, x, wq):
        picks = n.cache.get("lin_tactics")
        name = picks.get(tuple(x.shape)) if picks else None
        if name is None:
            name = _pick(n, tuple(x.shape), ["fbgemm", "qgemm"] if _fbgemm_ok(x) else
                         ["qgemm"], lambda t: _QDQ[t](n, x, wq, w_scale),
                         ("qdq", tuple(x.shape), tuple(wq.shape), str(wq.dtype)))
        return _QDQ[name](n, x, wq, w_scale)
    return _qdq_fbgemm(n, x, wq, w_scale)


def _qdq_mult(n, a, w_scale):
    """QLinearMatMul's requantization multipliers x_scale * w_scale / y_scale (float32)."""
    return _cached(n, ("mult", w_scale.device), lambda: (
        torch.tensor(a.x_scale, dtype=torch.float32) * w_scale.float().reshape(-1)) /
        torch.tensor(a.y_scale, dtype=torch.float32))


def _qdq_qgemm(n, x, wq, w_scale):
    """qgemm.c: x's codes by x_scale/x_zero in C, exact int32 products, the requantization and
    dequantization in its epilogue (the float32 steps of :func:`_qdq_fbgemm`)."""
    from kiln import native

    a = n.a
    k, m = wq.shape
    w = _cached(n, "w_qgemm", lambda: native.QGemmWeight(wq))
    mult = _qdq_mult(n, a, w_scale).contiguous()
    lo, hi = (-128, 127) if a.y_signed else (0, 255)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = native.qgemm_f32(x2, a.x_scale, a.x_zero, w, mult, requant=(a.y_scale, a.y_zero, lo, hi))
    return y.reshape(*x.shape[:-1], m)


def _qdq_fbgemm(n, x, wq, w_scale):
    """The int32 products ``acc`` of x's codes (minus x_zero) and the weight codes, requantized
    in onnxruntime's float32 steps (QLinearMatMul's MlasRequantizeOutput): ``round(acc *
    mult) + y_zero`` saturated, ``mult = x_scale * w_scale / y_scale`` per column; then
    dequantized by y_scale. FBGEMM computes ``acc`` (given the shifted codes with scale 1,
    which it quantizes back to the codes exactly, and a weight packed with scale 1; its float
    ``acc`` is the int32 one converted, as onnxruntime converts it), a float32 matmul of the
    codes elsewhere (exact below 2**24)."""
    from kiln import native

    a = n.a
    k, m = wq.shape
    xf = x.float().reshape(-1, k)
    fast = native.available and xf.device.type == "cpu" and xf.is_contiguous()
    if fast:
        codes = native.shifted_codes(xf, a.x_scale, a.x_zero)
    else:
        codes = torch.div(xf, a.x_scale).round_().add_(a.x_zero).clamp_(0, 255).sub_(a.x_zero)
    if _fbgemm_ok(xf):
        packed = _cached(n, "w_fbgemm_unit", lambda: _fbgemm_pack(wq, torch.ones(m), None))
        acc = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            codes.contiguous(), 1.0, a.x_zero, packed)
    else:
        acc = torch.matmul(codes, wq.float())
    mult = _qdq_mult(n, a, w_scale)
    lo, hi = (-128, 127) if a.y_signed else (0, 255)
    if fast and acc.is_contiguous() and mult.is_contiguous():
        y = native.requantize_(acc, mult, a.y_scale, a.y_zero, lo, hi)
    else:
        y = acc.mul_(mult).round_().add_(a.y_zero).clamp_(lo, hi).sub_(a.y_zero).mul_(a.y_scale)
    return y.reshape(*x.shape[:-1], m).to(x.dtype)


_QDQ = {"fbgemm": _qdq_fbgemm, "qgemm": _qdq_qgemm}


class _WithAttrs:
    """A node's call seen with other attributes (a dynamic layer's per-call scale)."""

    def __init__(self, call, attrs):
        self.call, self.a = call, attrs

    @property
    def cache(self):
        return self.call.cache


def dequantize_codes(x, a) -> torch.Tensor:
    """``x`` through the quantizer and back: what an INT8 layer sees of its input (as
    integers ``code - zero``, float32). An int8 ``x`` is codes already (a quantized hand-off:
    ``round(x / x_scale) + x_zero - 128``)."""
    if x.dtype == torch.int8:
        return x.float() - (a.x_zero - 128)
    q = torch.clamp(torch.round(torch.div(x.float(), a.x_scale)) + a.x_zero, 0, 255)
    return q - a.x_zero


CODES = (torch.int8, torch.float8_e4m3fn)


def handoff(a, x) -> bool:
    """Whether a layer takes or gives codes (kiln.ops.int8's hand-off attributes)."""
    return x.dtype in CODES or getattr(a, "out_scale", 0.0) > 0


def float_dtype(a, x) -> torch.dtype:
    """The float dtype a layer computes in: X's, or ``out_float`` where X is codes."""
    if x.dtype not in CODES:
        return x.dtype
    from kiln.ir import DType
    from kiln.kernels.torch.convert import TORCH_DTYPE

    return TORCH_DTYPE[DType(a.out_float)] if a.out_float else torch.float32


E4M3_MAX = 448.0


def encode_out(y: torch.Tensor, a, fp8: bool = False) -> torch.Tensor:
    """``y`` as its reader's codes where the layer has ``out_scale`` (else ``y``): int8
    ``clamp(floor(y / s + 0.5) + zero - 128)`` as kiln's Triton kernels round, or e4m3."""
    s = getattr(a, "out_scale", 0.0)
    if s <= 0:
        return y
    if fp8:
        return torch.div(y.float(), s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = torch.div(y.float(), s).add_(0.5).floor_().add_(a.out_zero - 128)
    return q.clamp_(-128, 127).to(torch.int8)


def _int8_matmul_emulated(n, x, wq, w_scale, b, r):
    a = n.a
    y = torch.matmul(dequantize_codes(x, a), wq.float()) * (w_scale * a.x_scale)
    if b is not None:
        y = y + b
    return encode_out(epilogue(y.to(float_dtype(a, x)), a, r), a)


@register(I8.Int8Conv)
def int8_conv(n, x, wq, w_scale, b=None, r=None):
    a = n.a
    geo = symmetric_geometry(n, x, wq) if x.dim() == 4 else None
    if not _onednn(x) or geo is None or handoff(a, x):
        return _int8_conv_emulated(n, x, wq, w_scale, b, r)
    pad, stride, dil, _ = geo
    groups = a.group or 1
    packed = _cached(n, "w_packed", lambda: torch.ops.onednn.qconv_prepack(
        wq.contiguous(), w_scale, a.x_scale, a.x_zero, stride, pad, dil, groups, None))
    zeros = _cached(n, "w_zero", lambda: torch.zeros(wq.shape[0], dtype=torch.long))
    attr, scalars, algo, after = _post_op(a, r)
    xq = quantize_u8_fast(x.contiguous(memory_format=torch.channels_last), a.x_scale, a.x_zero)
    y = torch.ops.onednn.qconv2d_pointwise(
        xq, a.x_scale, a.x_zero, packed, w_scale, zeros, b, stride, pad, dil, groups, 1.0, 0,
        torch.float32, attr, scalars, algo or None)
    return epilogue(y, a, r) if after else y


def _int8_conv_emulated(n, x, wq, w_scale, b, r):
    from kiln.kernels.torch.quant_linear import conv_nd

    a = n.a
    y = conv_nd(dequantize_codes(x, a), wq.float(), None, a)
    y = y * (w_scale * a.x_scale).reshape((1, -1) + (1,) * (y.dim() - 2))
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * (y.dim() - 2))
    y = y.to(float_dtype(a, x))
    if r is not None:
        y = y + r
    return encode_out(_TORCH_ACT[a.activation](y, a), a)


@register(I8.QuantizeDequantize)
def quantize_dequantize(n, x):
    """One pass of kiln's C kernel on the CPU (the same float32 steps as QuantizeLinear +
    DequantizeLinear: divide, round half to even, add the zero point, clamp, subtract, scale);
    those steps in torch elsewhere."""
    from kiln import native

    a = n.a
    if native.available and x.device.type == "cpu" and x.dtype == torch.float32 and \
            x.dim() <= 6:
        op = "QuantizeDequantizeS8" if a.signed else "QuantizeDequantizeU8"
        return native.pointwise(op, x, p0=a.scale, p1=float(a.zero))
    lo, hi = (-128, 127) if a.signed else (0, 255)
    q = torch.round(torch.div(x.float(), a.scale)).add_(a.zero).clamp_(lo, hi)
    return q.sub_(a.zero).mul_(a.scale).to(x.dtype)


def qlinear_mult(a) -> float:
    """QLinearMatMul's requantization multiplier float32(a_scale * b_scale) / y_scale, in
    float32 as onnxruntime computes it."""
    import numpy as np

    f = np.float32
    return float(f(f(a.a_scale) * f(a.b_scale)) / f(a.y_scale))


def _codes(x: torch.Tensor, scale: float, zero: int, signed: int) -> torch.Tensor:
    """QuantizeLinear's codes minus the zero point, as float64 integers."""
    lo, hi = (-128, 127) if signed else (0, 255)
    q = torch.round(torch.div(x.float(), scale)).add_(zero).clamp_(lo, hi).sub_(zero)
    return q.double()


@register(I8.QLinearMatMulQDQ)
def qlinear_matmul_qdq(n, a, b):
    """kiln's integer batched matmul (qgemm.c's kiln_qbmm_qdq) on the CPU; elsewhere the same
    steps in torch: the codes minus their zero points, their products summed exactly in
    float64, converted to float32, requantized and dequantized in float32."""
    from kiln import native

    at = n.a
    mult = _cached(n, "mult", lambda: qlinear_mult(at))
    qa, qb = ((at.a_scale, at.a_zero, at.a_signed), (at.b_scale, at.b_zero, at.b_signed))
    qy = (at.y_scale, at.y_zero, at.y_signed)
    if native.available and a.device.type == "cpu" and b.device.type == "cpu" and \
            a.dtype == torch.float32 and b.dtype == torch.float32 and \
            native.qbmm_strides(a, b) is not None:
        return native.qbmm_qdq(a, b, qa, qb, qy, mult)
    acc = torch.matmul(_codes(a, *qa), _codes(b, *qb)).float()
    lo, hi = (-128, 127) if at.y_signed else (0, 255)
    y = acc.mul_(mult).round_().add_(at.y_zero).clamp_(lo, hi).sub_(at.y_zero)
    return y.mul_(at.y_scale).to(a.dtype)


@register(I8.LayerNormQuant)
def layer_norm_quant(n, x, scale, bias, qmul):
    """LayerNormalization, and its output as codes ``y * qmul`` (int8 ``floor(. + 0.5) +
    zshift``, saturated; or e4m3): the form kiln's Triton kernel computes in one pass."""
    import dataclasses

    from kiln.kernels.torch import nn_norm

    a = n.a
    y = nn_norm.layer_norm(dataclasses.replace(n, n_out=1), x, scale, bias)
    q = y.float() * qmul.float()
    if a.fp8:
        return y, q.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return y, q.add_(0.5).floor_().add_(a.zshift).clamp_(-128, 127).to(torch.int8)
