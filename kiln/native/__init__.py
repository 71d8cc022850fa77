"""kiln's compiled CPU kernels (plain C, loaded with ctypes; no Python C API).

``pip install -e .`` (or ``python setup.py build_ext --inplace``) compiles the C files here into
``kiln/native/_kernels*.so`` with the system's C compiler: one file per kernel (``gemm.c``,
``layernorm.c``, ``attention.c``, ``winograd.c``, ``pointwise.c``, ``pool.c``,
``depthwise.c``, ``chain.c``, ``rnn.c``, bound in :mod:`kiln.native.rnn`; ``llm.c``, bound
here), what they share in ``kernels.h``.
The library is optional: where it was not built, or this CPU lacks AVX2 + FMA, :data:`sgemm` is
None, :data:`why_not` says why, and the CPU kernels use their library tactics instead.

The library links libgomp and is loaded after torch, so it shares torch's OpenMP runtime and
its thread pool: a second pool would spin against torch's on the same cores.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

import numpy as np
import torch

from kiln.ops.rules import broadcast_ints

# kiln activation name -> the kernel's code (ACT_* in kernels.h); the kernel applies it in registers
ACTIVATIONS = {"": 0, "Relu": 1, "Gelu": 2, "GeluTanh": 3, "Sigmoid": 4, "Silu": 5, "Tanh": 6,
               "Clip": 7, "LeakyRelu": 8, "HardSwish": 9, "HardSwishAffine": 20}
_HERE = Path(__file__).resolve().parent
_L, _P, _I, _F = ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ALIGN = 32  # bytes: packed panels are read with aligned 256-bit loads


def _find() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = _HERE / f"_kernels{suffix}"
        if p.exists():
            return p
    return None


def _load():
    path = _find()
    if path is None:
        return None, ("kiln/native/_kernels is not built: reinstall kiln with a C compiler "
                      "present (pip install -e .) or run python setup.py build_ext --inplace")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"{path.name} does not load: {e}"
    if not lib.kiln_sgemm_supported():
        return None, "this CPU lacks AVX2 + FMA, which kiln's GEMM kernel needs"
    lib.kiln_sgemm.argtypes = [_L, _L, _L, _P, _L, _P, _P, _P, _L, _P, _L, _I, _F, _F, _I]
    lib.kiln_sgemm.restype = None
    lib.kiln_sgemm_pack.argtypes = [_L, _L, _P, _L, _L, _P]
    lib.kiln_sgemm_pack.restype = None
    lib.kiln_sgemm_packed_size.argtypes = [_L, _L]
    lib.kiln_sgemm_packed_size.restype = _L
    lib.kiln_layernorm_to.argtypes = [_L, _L, _P, _L, _P, _L, _P, _P, _F, _I]
    lib.kiln_layernorm_to.restype = None
    lib.kiln_attention.argtypes = ([_L] * 7 + [_P, _L, _L, _L] * 3 + [_P, _L, _L, _L, _L]
                                   + [_L, _F, _P, _L, _L, _L, _I])
    lib.kiln_attention.restype = _I
    lib.kiln_wino_packed_size.argtypes = [_L, _L]
    lib.kiln_wino_packed_size.restype = _L
    lib.kiln_wino_pack.argtypes = [_L, _L, _P, _P]
    lib.kiln_wino_pack.restype = _I
    lib.kiln_wino3x3.argtypes = [_L] * 9 + [_P] * 5 + [_I, _F, _F, _L, _I]
    lib.kiln_wino3x3.restype = _I
    lib.kiln_chain_run.argtypes = [_P, _L, _P, _P, _I]
    lib.kiln_chain_run.restype = _L
    lib.kiln_chain_run_timed.argtypes = [_P, _L, _P, _P, _I, _P]
    lib.kiln_chain_run_timed.restype = _L
    lib.kiln_pointwise.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _P, _F, _F, _I]
    lib.kiln_pointwise.restype = None
    lib.kiln_pool2d.argtypes = [_I, _P, _P, _P, _P, _P, _I]
    lib.kiln_pool2d.restype = None
    lib.kiln_resize_linear2d.argtypes = [_L] * 6 + [_P] * 10 + [_I]
    lib.kiln_resize_linear2d.restype = None
    lib.kiln_softmax_rows.argtypes = [_L, _L, _P, _L, _P, _L, _I]
    lib.kiln_softmax_rows.restype = None
    lib.kiln_dw_pack.argtypes = [_L, _L, _L, _P, _P]
    lib.kiln_dw_pack.restype = None
    lib.kiln_depthwise.argtypes = [_P, _P, _P, _P, _P, _P, _I, _F, _F, _I]
    lib.kiln_depthwise.restype = None
    lib.kiln_conv_packed_size.argtypes = [_L, _L, _L, _L]
    lib.kiln_conv_packed_size.restype = _L
    lib.kiln_conv_pack.argtypes = [_L, _L, _L, _L, _P, _P]
    lib.kiln_conv_pack.restype = _I
    lib.kiln_conv.argtypes = [_P, _P, _P, _P, _P, _P, _I, _F, _F, _I]
    lib.kiln_conv.restype = _I
    lib.kiln_team_rest.argtypes = []
    lib.kiln_team_rest.restype = None
    lib.kiln_qgemv.argtypes = [_I, _L, _L, _L, _P, _L, _P, _P, _P, _L, _I, _I]
    lib.kiln_qgemv.restype = None
    lib.kiln_qrow_bytes.argtypes = [_I, _L]
    lib.kiln_qrow_bytes.restype = _L
    lib.kiln_qdequant.argtypes = [_I, _L, _L, _P, _P, _I]
    lib.kiln_qdequant.restype = None
    lib.kiln_llm_scratch_floats.argtypes = [_P]
    lib.kiln_llm_scratch_floats.restype = _L
    lib.kiln_llm_ptrs_per_layer.restype = _L
    lib.kiln_llm_decode.argtypes = [_P] * 9 + [_F, _P, _I]
    lib.kiln_llm_decode.restype = None
    lib.kiln_conv_set_isa.argtypes = [_I]
    lib.kiln_conv_set_isa.restype = _I
    lib.kiln_conv_isa_best.argtypes = []
    lib.kiln_conv_isa_best.restype = _I
    lib.kiln_llm_set_isa.argtypes = [_I]
    lib.kiln_llm_set_isa.restype = _I
    lib.kiln_dynamic_quantize.argtypes = [_L, _P, _P, _P, _P, _I]
    lib.kiln_dynamic_quantize.restype = None
    lib.kiln_dynamic_qdq.argtypes = [_L, _P, _P, _P, _P, _I]
    lib.kiln_dynamic_qdq.restype = None
    lib.kiln_shifted_codes.argtypes = [_L, _P, _P, _F, _F]
    lib.kiln_shifted_codes.restype = None
    lib.kiln_requantize.argtypes = [_L, _L, _P, _P, _F, _F, _F, _F]
    lib.kiln_requantize.restype = None
    lib.kiln_qgemm_best_path.argtypes = []
    lib.kiln_qgemm_best_path.restype = _I
    lib.kiln_qgemm_packed_size.argtypes = [_I, _L, _L]
    lib.kiln_qgemm_packed_size.restype = _L
    lib.kiln_qgemm_pack.argtypes = [_I, _L, _L, _P, _P]
    lib.kiln_qgemm_pack.restype = None
    lib.kiln_qgemm.argtypes = [_I, _L, _L, _L, _P, _L, _I, _P, _P, _F, _P, _L, _P, _P, _L, _I,
                               _P, _P, _L, _I]
    lib.kiln_qgemm.restype = _I
    lib.kiln_qgemm_f32.argtypes = [_I, _L, _L, _L, _P, _L, _F, _I, _P, _P, _P, _L, _P, _P, _L,
                                   _I, _P, _P, _L, _I]
    lib.kiln_qgemm_f32.restype = _I
    lib.kiln_qgemm_f32_off.argtypes = [_I, _L, _L, _L, _P, _L, _F, _I, _P, _P, _I, _P, _L, _P,
                                       _P, _L, _I, _P, _P, _L, _I]
    lib.kiln_qgemm_f32_off.restype = _I
    lib.kiln_qconv.argtypes = [_L, _L, _L, _L, _P, _I, _I, _L, _L, _L, _L, _L, _L, _L, _L, _L,
                               _L, _L, _P, _I, _P, _P, _F, _P, _I]
    lib.kiln_qconv.restype = _I
    lib.kiln_dq_qconv.argtypes = [_L, _L, _L, _L, _P] + [_L] * 11 + [_P, _I, _P, _P, _F, _P,
                                                                     _I]
    lib.kiln_dq_qconv.restype = _I
    lib.kiln_qbmm_qdq.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _I]
    lib.kiln_qbmm_qdq.restype = _I
    return lib, ""


def _tile(lib) -> tuple[int, int, int] | None:
    if lib is None:
        return None
    mr, nr, kc = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    lib.kiln_sgemm_tile(ctypes.byref(mr), ctypes.byref(nr), ctypes.byref(kc))
    return mr.value, nr.value, kc.value


_lib, why_not = _load()
TILE = _tile(_lib)  # (rows, columns of the register tile, K block); None without the library


def _aligned(size: int) -> torch.Tensor:
    """``size`` float32 elements whose first is ``_ALIGN``-byte aligned."""
    buf = torch.empty(size + _ALIGN // 4, dtype=torch.float32)
    off = (-buf.data_ptr() % _ALIGN) // 4
    return buf[off:off + size]


class PackedWeight:
    """A [K, N] float32 weight packed into the kernel's panels (its own memory, the size of
    the weight rounded up to whole panels of ``TILE[1]`` columns)."""

    def __init__(self, w: torch.Tensor):
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"PackedWeight: expected a 2-D float32 CPU tensor, got "
                             f"{tuple(w.shape)} {w.dtype} on {w.device}")
        self.k, self.n = w.shape
        self.data = _aligned(_lib.kiln_sgemm_packed_size(self.k, self.n))
        _lib.kiln_sgemm_pack(self.k, self.n, w.data_ptr(), w.stride(0), w.stride(1),
                             self.data.data_ptr())


def gemm(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, activation: str = "", alpha: float | None = None,
         beta: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ W + bias + residual)`` for a 2-D float32 ``x`` [M, K] (K >= 1) whose rows are
    contiguous, a contiguous ``bias`` [N] and a ``residual`` [M, N] with contiguous rows, on
    ``torch.get_num_threads()`` threads. ``activation`` is a key of :data:`ACTIVATIONS`;
    ``alpha``/``beta`` are Clip's bounds (None: unbounded) or LeakyRelu's slope (``alpha``,
    default 0.01). NaN propagates through every activation."""
    if out is None:
        out = torch.empty((x.shape[0], w.n), dtype=torch.float32)
    return gemm_fn(w, bias, activation, alpha, beta)(x, residual, out)


class WinogradWeight:
    """A [K, C, 3, 3] float32 conv weight transformed for Winograd F(2x2, 3x3) (U = G g G^T,
    in double, rounded once) and packed as 16 GEMM weights [C, K], one per transform position
    (its own memory, 16/9 of the weight's size; the transform, in C, needs 4/9 of it besides).
    C and K must be multiples of 8."""

    def __init__(self, w: torch.Tensor):
        if (w.dim() != 4 or tuple(w.shape[2:]) != (3, 3) or w.dtype != torch.float32
                or w.device.type != "cpu" or w.shape[0] % 8 or w.shape[1] % 8):
            raise ValueError(f"WinogradWeight: expected a float32 CPU [K, C, 3, 3] weight with K "
                             f"and C multiples of 8, got {tuple(w.shape)} {w.dtype} on "
                             f"{w.device}")
        self.k, self.c = w.shape[:2]
        w = w.contiguous()
        self.data = _aligned(_lib.kiln_wino_packed_size(self.c, self.k))
        if _lib.kiln_wino_pack(self.c, self.k, w.data_ptr(), self.data.data_ptr()) != 0:
            raise MemoryError("WinogradWeight: no scratch memory for the transform")


def conv3x3_fn(w: WinogradWeight, bias: torch.Tensor | None = None, activation: str = "",
               alpha: float | None = None, beta: float | None = None):
    """A 3x3 convolution (stride 1, dilation 1, one group) by Winograd F(2x2, 3x3), its weight,
    bias and epilogue bound once: a function ``(x, pad, residual, out) -> out`` computing
    ``out = act(conv(x, W) + bias + residual)`` on NHWC tensors: ``x`` [N, H, W, C] and ``out``
    (and ``residual``, or None) [N, Ho, Wo, K], all contiguous float32; ``pad`` = (top, left),
    the bottom and right padding being what Ho and Wo imply. Runs on
    ``torch.get_num_threads()`` threads; activations as in :func:`gemm`."""
    code, lo, hi, bp = _epilogue("conv3x3", w.k, bias, activation, alpha, beta)
    call, k, c, wp = _lib.kiln_wino3x3, w.k, w.c, w.data.data_ptr()

    def run(x: torch.Tensor, pad: tuple[int, int], residual: torch.Tensor | None,
            out: torch.Tensor) -> torch.Tensor:
        n, h, wd, cx = x.shape
        ho, wo = out.shape[1:3]
        if (cx != c or out.shape != (n, ho, wo, k) or not x.is_contiguous()
                or not out.is_contiguous() or x.dtype != torch.float32
                or out.dtype != torch.float32 or min(pad) < 0 or min(ho, wo) < 1
                or ho - h + 2 - pad[0] < 0 or wo - wd + 2 - pad[1] < 0  # bottom, right pads
                or (residual is not None and (residual.shape != out.shape
                                              or not residual.is_contiguous()))):
            raise ValueError(f"conv3x3: x {tuple(x.shape)}, pad {pad}, out {tuple(out.shape)} do "
                             f"not fit a [{k}, {c}, 3, 3] weight (contiguous NHWC float32)")
        rc = call(n, h, wd, c, k, ho, wo, pad[0], pad[1], x.data_ptr(), wp, bp,
                  None if residual is None else residual.data_ptr(), out.data_ptr(), code, lo,
                  hi, 0, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("conv3x3: the kernel could not allocate its scratch memory")
        return out
    run.keep = (w, bias)
    return run


def layer_norm_fits(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`layer_norm_` takes these tensors."""
    f32 = torch.float32

    def vector(t) -> bool:
        return t.shape == y.shape[-1:] and t.is_contiguous() and t.dtype == f32

    return (y.dim() >= 1 and y.shape[-1] >= 1 and y.device.type == "cpu" and y.dtype == f32
            and y.is_contiguous() and vector(scale) and (bias is None or vector(bias)))


def layer_norm_(y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    """LayerNormalization of a contiguous float32 ``y`` over its last dim, in place:
    ``(y - mean) / sqrt(var + eps) * scale + bias`` per row (the mean and the biased variance in
    float32, two passes), rows split over ``torch.get_num_threads()`` threads. ``scale`` and
    ``bias`` are contiguous float32 vectors as long as the last dim. Returns ``y``."""
    if not layer_norm_fits(y, scale, bias):
        raise ValueError(f"layer_norm_: y {tuple(y.shape)} {y.dtype} on {y.device} (contiguous: "
                         f"{y.is_contiguous()}) with scale {tuple(scale.shape)}: expected a "
                         f"contiguous float32 CPU y and float32 vectors of its last dim")
    n = y.shape[-1]
    _lib.kiln_layernorm_to(y.numel() // n, n, y.data_ptr(), n, y.data_ptr(), n,
                           scale.data_ptr(), None if bias is None else bias.data_ptr(), eps,
                           torch.get_num_threads())
    return y


def attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   bias: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether :func:`attention` takes these tensors: float32 CPU, 4-D (B, H, S, D) with the
    last dim contiguous, key and value heads dividing the query heads, and a bias that
    broadcasts to (B, H, Sq, Skv)."""
    t4 = (q, k, v, out)
    if any(t.dim() != 4 or t.dtype != torch.float32 or t.device.type != "cpu"
           or t.stride(3) != 1 for t in t4) or min(q.shape) < 1 or min(k.shape) < 1:
        return False
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if (k.shape != (b, hkv, skv, d) or v.shape[:3] != (b, hkv, skv) or h % hkv
            or out.shape != (b, h, sq, v.shape[3])):
        return False
    if bias is None:
        return True
    if bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.dim() > 4:
        return False
    try:
        return broadcast_ints(bias.shape, (b, h, sq, skv)) == (b, h, sq, skv)
    except ValueError:
        return False


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              scale: float, causal: int, out: torch.Tensor) -> torch.Tensor:
    """``out = softmax(scale q k^T + bias, causal) v`` per (batch, head) in float32, on
    ``torch.get_num_threads()`` threads. ``q`` (B, H, Sq, D), ``k`` (B, Hkv, Skv, D), ``v``
    (B, Hkv, Skv, Dv) and ``out`` (B, H, Sq, Dv) may be any strided views whose last dim is
    contiguous (``out`` is typically a (B, Sq, H, Dv) buffer seen as (B, H, Sq, Dv)); query head
    h reads key/value head h // (H / Hkv). ``bias`` broadcasts to (B, H, Sq, Skv) (additive,
    -inf masks a key). ``causal`` >= 0: query i sees only keys j <= i + causal; -1: no causal
    mask. A query row with no key allowed gets zeros (ONNX's rule)."""
    if not attention_fits(q, k, v, bias, out):
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, out {tuple(out.shape)}: expected float32 CPU "
                         f"(B, H, S, D) views with contiguous rows and a bias that broadcasts")
    b, h, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    bp, bs = None, (0, 0, 0, 0)
    if bias is not None:
        be = bias.expand(b, h, sq, skv)
        bp, bs = be.data_ptr(), be.stride()
    rc = _lib.kiln_attention(b, h, hkv, sq, skv, d, dv,
                             q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3],
                             v.data_ptr(), *v.stride()[:3], bp, *bs, causal, scale,
                             out.data_ptr(), *out.stride()[:3], torch.get_num_threads())
    if rc != 0:
        raise MemoryError("attention: the kernel could not allocate its scratch memory")
    return out


def chain_run(prog, n: int, fparams, table, nthreads: int | None = None) -> int:
    """Run a chain program (ctypes arrays made by :mod:`kiln.engine.chains`, or the address of
    a position in one) on ``nthreads`` (default ``torch.get_num_threads()``) threads; returns
    ``n``, or the position of the first op the library does not know (nothing from there on
    ran)."""
    return _lib.kiln_chain_run(prog, n, fparams, table,
                               torch.get_num_threads() if nthreads is None else nthreads)


def chain_run_timed(prog, n: int, fparams, table, nthreads: int, acc) -> int:
    """:func:`chain_run`, adding each record's seconds to ``acc`` (the address of a float64
    array, indexed by record position from ``prog``)."""
    return _lib.kiln_chain_run_timed(prog, n, fparams, table, nthreads, acc)


# elementwise op name -> kiln_pointwise's code (pointwise.c); activations keep their ACT_ codes
POINTWISE = {**{k: v for k, v in ACTIVATIONS.items() if k and k != "HardSwishAffine"},
             "Copy": 0, "Exp": 10, "Neg": 11,
             "Abs": 12, "Sqrt": 13, "Reciprocal": 14, "HardSigmoid": 15,
             "QuantizeDequantizeU8": 16, "QuantizeDequantizeS8": 17, "NonZero": 18,
             "Select": 19, "Add": 32, "Sub": 33, "Mul": 34, "Div": 35, "Max": 36, "Min": 37,
             "PRelu": 38, "SelectB": 39, "SelectA": 40, "NotEqual": 41}
BINARY = frozenset(k for k, v in POINTWISE.items() if v >= 32)
POOLS = {"max": 0, "avg_pad": 1, "avg": 2}


def team_rest() -> None:
    """Send kiln's spinning team workers to sleep now (team.c): before threaded work of
    another pool (torch's OpenMP threads), which they would otherwise hold a core from."""
    _lib.kiln_team_rest()


def _strides_arg(t: torch.Tensor, shape) -> ctypes.Array:
    """``t``'s strides over ``shape`` (broadcast dims 0), as the kernel takes them."""
    return (_L * max(1, len(shape)))(*t.expand(shape).stride())


def pointwise(op: str, a: torch.Tensor, b: torch.Tensor | None = None, p0: float = 0.0,
              p1: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``op`` (a key of :data:`POINTWISE`) of float32 CPU tensors of any strides, ``b``
    broadcasting against ``a`` (ONNX/NumPy rules), into ``out`` (default: a new contiguous
    tensor of the broadcast shape; it may be any strided view). ``p0``/``p1``: Clip's bounds,
    LeakyRelu's slope (p0), HardSigmoid's alpha and beta,
    QuantizeDequantize*'s scale and zero point. At most 6 dims."""
    shape = tuple(a.shape) if b is None else broadcast_ints(a.shape, b.shape)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    ts = (a, out) if b is None else (a, b, out)
    if (op not in POINTWISE or (b is not None) != (op in BINARY) or len(shape) > 6
            or tuple(out.shape) != shape
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts)):
        raise ValueError(f"pointwise {op}: a {tuple(a.shape)}, b "
                         f"{None if b is None else tuple(b.shape)}, out {tuple(out.shape)}: "
                         f"expected float32 CPU tensors of at most 6 dims that broadcast")
    sb = None if b is None else _strides_arg(b, shape)
    _lib.kiln_pointwise(POINTWISE[op], len(shape), (_L * max(1, len(shape)))(*shape),
                        out.data_ptr(), _strides_arg(out, shape), a.data_ptr(),
                        _strides_arg(a, shape), None if b is None else b.data_ptr(), sb,
                        p0, p1, torch.get_num_threads())
    return out


def dynamic_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DynamicQuantizeLinear of a contiguous float32 CPU tensor (quant.c): (uint8 codes, float32
    scale, uint8 zero point), the last two 0-D."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("dynamic_quantize: expected a contiguous float32 CPU tensor")
    y = torch.empty(x.shape, dtype=torch.uint8)
    sz = torch.empty(2, dtype=torch.float32)
    _lib.kiln_dynamic_quantize(x.numel(), x.data_ptr(), y.data_ptr(), sz.data_ptr(),
                               sz.data_ptr() + 4, torch.get_num_threads())
    return y, sz[0].clone(), sz[1].to(torch.uint8)


def dynamic_qdq(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """DynamicQuantizeLinear then DequantizeLinear of a contiguous float32 CPU tensor
    (quant.c): (``(codes - zero) * scale`` as float32, scale, uint8 zero point), the codes
    those of :func:`dynamic_quantize`."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("dynamic_qdq: expected a contiguous float32 CPU tensor")
    y = torch.empty(x.shape, dtype=torch.float32)
    sz = (ctypes.c_float * 2)()
    _lib.kiln_dynamic_qdq(x.numel(), x.data_ptr(), y.data_ptr(), ctypes.addressof(sz),
                          ctypes.addressof(sz) + 4, torch.get_num_threads())
    return y, float(sz[0]), int(sz[1])


def shifted_codes(x: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
    """``clamp(round(x / scale) + zero, 0, 255) - zero`` of a contiguous float32 CPU tensor
    (quant.c), as float32."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("shifted_codes: expected a contiguous float32 CPU tensor")
    y = torch.empty(x.shape, dtype=torch.float32)
    _lib.kiln_shifted_codes(x.numel(), x.data_ptr(), y.data_ptr(), scale, float(zero))
    return y


# qgemm.c's paths: the portable loop, AVX2's vpmaddwd on int16, AVX512-VNNI's vpdpbusd
QGEMM_PATHS = {"scalar": 1, "avx2": 2, "vnni": 3}


def qgemm_paths() -> list[str]:
    """The u8 x s8 GEMM paths this CPU runs (qgemm.c), the fastest last."""
    best = _lib.kiln_qgemm_best_path()
    return [name for name, code in QGEMM_PATHS.items() if code <= best]


class QGemmWeight:
    """An int8 weight [K, N] (zero point 0) packed for qgemm.c's ``path`` (None: the fastest
    this CPU has, or the environment's ``KILN_QGEMM_PATH``; "scalar", "avx2", "vnni" force
    one), with its column sums."""

    def __init__(self, wq: torch.Tensor, path: str | None = None):
        if wq.dtype != torch.int8 or wq.dim() != 2 or wq.device.type != "cpu":
            raise ValueError(f"QGemmWeight: expected an int8 CPU [K, N] weight, got "
                             f"{wq.dtype} {tuple(wq.shape)} on {wq.device}")
        path = path or os.environ.get("KILN_QGEMM_PATH") or qgemm_paths()[-1]
        if path not in QGEMM_PATHS or path not in qgemm_paths():
            raise ValueError(f"QGemmWeight: path {path!r} is not one this CPU runs "
                             f"({', '.join(qgemm_paths())})")
        self.k, self.n = wq.shape
        self.path, self.code = path, QGEMM_PATHS[path]
        w = wq.contiguous()
        self.packed = torch.empty(_lib.kiln_qgemm_packed_size(self.code, self.k, self.n),
                                  dtype=torch.uint8)
        _lib.kiln_qgemm_pack(self.code, self.k, self.n, w.data_ptr(), self.packed.data_ptr())
        # numpy's int8 column sums: torch's took 27-87 ms on a [1024, 8210] weight, numpy's 2
        self.colsum = torch.from_numpy(w.numpy().sum(0, dtype=np.int32))


class QConvWeight:
    """A constant 8-bit convolution weight [OC, C, kh, kw] with one zero point, prepared for
    qconv.c: uint8 codes ``w + woff`` [OC, K] (woff 128 for int8), their zero point, and
    each output channel's ``sum(w - w_zero)``."""

    def __init__(self, w: torch.Tensor, w_zero: int):
        if w.dtype not in (torch.uint8, torch.int8) or w.dim() != 4 or w.device.type != "cpu":
            raise ValueError(f"QConvWeight: expected an 8-bit CPU [OC, C, kh, kw] weight, got "
                             f"{w.dtype} {tuple(w.shape)} on {w.device}")
        woff = 128 if w.dtype == torch.int8 else 0
        wi = w.to(torch.int32).reshape(w.shape[0], -1)
        self.shape = tuple(w.shape)
        self.codes = (wi + woff).to(torch.uint8).contiguous()
        self.a_zero = int(w_zero) + woff
        self.wsum = (wi - int(w_zero)).sum(1, dtype=torch.int32).contiguous()


def qconv_available() -> bool:
    """Whether qconv.c (and the other VNNI-only kernels: the DynamicQuantizeLSTM step) runs
    here: it needs AVX512-VNNI, and ``KILN_QGEMM_PATH`` unset or "vnni" (forcing qgemm's
    avx2 or scalar path turns them off too, so that tests run a CPU without VNNI's kernels)."""
    return available and _lib.kiln_qgemm_best_path() >= QGEMM_PATHS["vnni"] and \
        os.environ.get("KILN_QGEMM_PATH", "") in ("", "vnni")


class QConvPlan:
    """qconv.c's call for one input shape and dtype [N, C, H, W], one prepared weight and its
    geometry (``pads`` = (top, left, bottom, right)), checked and laid out once."""

    def __init__(self, shape, dtype, w: QConvWeight, strides, pads, dilations):
        oc, c, kh, kw = w.shape
        if dtype not in (torch.uint8, torch.int8) or len(shape) != 4 or shape[1] != c:
            raise ValueError(f"qconv: expected 8-bit codes [N, {c}, H, W], got {dtype} "
                             f"{tuple(shape)}")
        (sh, sw), (ph, pw, pb, pr), (dh, dw) = strides, pads, dilations
        n, _, h, wd = shape
        oh = (h + ph + pb - dh * (kh - 1) - 1) // sh + 1
        ow = (wd + pw + pr - dw * (kw - 1) - 1) // sw + 1
        self.shape, self.dtype, self.w, self.out = tuple(shape), dtype, w, (n, oc, oh, ow)
        self.head = (n, c, h, wd)
        self.geo = (oc, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, w.codes.data_ptr(), w.a_zero,
                    w.wsum.data_ptr())
        self.signed = int(dtype == torch.int8)

    def run(self, x: torch.Tensor, x_zero: int, bias: torch.Tensor | None = None,
            scale: float = 0.0) -> torch.Tensor:
        """int32 sums (``scale`` 0) or ConvIntegerScaled's float32 output (see :func:`qconv`);
        ``bias`` contiguous float32 [OC] or None."""
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(f"qconv: planned for {self.dtype} {self.shape}, got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(self.out, dtype=torch.float32 if scale else torch.int32)
        rc = _lib.kiln_qconv(*self.head, x.data_ptr(), self.signed, int(x_zero), *self.geo,
                             None if bias is None else bias.data_ptr(), float(scale),
                             y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("qconv: this CPU has no AVX512-VNNI, or out of memory")
        return y

    def run_dynamic(self, x: torch.Tensor, bias: torch.Tensor | None, w_scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """DynamicQuantizeLinear of the float32 ``x`` (of the planned shape; its uint8 codes
        are what the plan takes) in C, then ConvIntegerScaled with ``S = x_scale * w_scale``
        (qconv.c's kiln_dq_qconv): float32 [N, OC, OH, OW]."""
        if tuple(x.shape) != self.shape or x.dtype != torch.float32 or self.dtype != torch.uint8:
            raise ValueError(f"qconv: planned for the float32 input of {self.shape}, got "
                             f"{x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(self.out, dtype=torch.float32) if out is None else out
        oc, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, codes, a_zero, wsum = self.geo
        rc = _lib.kiln_dq_qconv(*self.head, x.data_ptr(), oc, kh, kw, sh, sw, ph, pw, dh, dw,
                                oh, ow, codes, a_zero, wsum,
                                None if bias is None else bias.data_ptr(), float(w_scale),
                                y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("qconv: this CPU has no AVX512-VNNI, or out of memory")
        return y


def qconv(x: torch.Tensor, x_zero: int, w: QConvWeight, strides, pads, dilations,
          bias: torch.Tensor | None = None, scale: float = 0.0) -> torch.Tensor:
    """``conv(x - x_zero, w - w_zero)`` of 8-bit codes ``x`` [N, C, H, W] (zero padding in
    code space: the code x_zero), one group: int32 [N, OC, OH, OW] where ``scale`` is 0, else
    ``float32(sums + floor(bias / scale)) * scale`` (ConvIntegerScaled; ``bias`` float32
    [OC] or None). ``pads`` = (top, left, bottom, right); exact (qconv.c, AVX512-VNNI)."""
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != w.shape[0]):
        raise ValueError(f"qconv: bias must be float32 of {w.shape[0]} values")
    plan = QConvPlan(tuple(x.shape), x.dtype, w, strides, pads, dilations)
    return plan.run(x, x_zero, None if bias is None else bias.reshape(-1).contiguous(), scale)


QACT_REQUANT = 100  # qgemm.c's epilogue that requantizes (QLinearMatMul) instead
QACT_INT32 = 101  # qgemm.c's epilogue that stores the int32 sums (MatMulInteger)


def _qgemm_epilogue(w, w_scale, bias, residual, m, activation, alpha, beta, requant, out):
    """Checked arguments of qgemm.c's epilogue: (w_scale, bias, residual, its row stride, act
    code, float params, out)."""
    ws = w_scale.reshape(-1)
    if ws.dtype != torch.float32 or ws.numel() not in (1, w.n) or not ws.is_contiguous():
        raise ValueError(f"qgemm: w_scale must be float32 of 1 or {w.n} values")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != w.n or
                             not bias.is_contiguous()):
        raise ValueError(f"qgemm: bias must be contiguous float32 of {w.n} values")
    if residual is not None and (residual.dtype != torch.float32 or residual.dim() != 2 or
                                 tuple(residual.shape) != (m, w.n) or residual.stride(1) != 1):
        raise ValueError(f"qgemm: residual must be float32 [{m}, {w.n}] with contiguous rows")
    if activation not in ACTIVATIONS:
        raise ValueError(f"qgemm: activation {activation!r} is not one of kiln's "
                         f"({', '.join(k for k in ACTIVATIONS if k)})")
    ep = (ctypes.c_float * 6)(*_epilogue_params(activation, alpha, beta), 0.0, 0.0, 0.0, 0.0)
    act = ACTIVATIONS[activation]
    if requant is not None:
        if bias is not None or residual is not None or activation:
            raise ValueError("qgemm: requant takes no bias, residual or activation")
        act = QACT_REQUANT
        ep[2:6] = [float(v) for v in requant]
    if out is None:
        out = torch.empty(m, w.n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, w.n) or out.stride(1) != 1:
        raise ValueError(f"qgemm: out must be float32 [{m}, {w.n}] with contiguous rows")
    return ws, bias, residual, 0 if residual is None else residual.stride(0), act, ep, out


def qgemm(codes: torch.Tensor, a_zero: int, a_scale: float, w: QGemmWeight,
          w_scale: torch.Tensor, bias: torch.Tensor | None = None,
          residual: torch.Tensor | None = None, activation: str = "", alpha=None, beta=None,
          requant: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(float(codes @ wq - a_zero * colsum(wq)) * (a_scale * w_scale) (+ bias) (+
    residual))`` of uint8 ``codes`` [M, K] (rows contiguous) and a packed int8 weight
    (qgemm.c): the int32 sums exact, the float steps onnxruntime's MatMulInteger -> Cast -> Mul
    (-> Add). ``w_scale`` float32 of 1 or N values, ``bias`` float32 [N], ``residual`` float32
    [M, N], ``activation`` a key of :data:`ACTIVATIONS` (``alpha``/``beta`` as in
    :func:`gemm`). ``requant`` = (y_scale, y_zero, lo, hi): instead, ``(clamp(round(float(...)
    * w_scale) + y_zero, lo, hi) - y_zero) * y_scale`` (``w_scale`` the whole multipliers,
    ``a_scale`` unused), QLinearMatMul's requantization dequantized."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != w.k or \
            codes.stride(1) != 1:
        raise ValueError(f"qgemm: expected uint8 codes [M, {w.k}] with contiguous rows, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    m = codes.shape[0]
    ws, bias, r, ldr, act, ep, y = _qgemm_epilogue(w, w_scale, bias, residual, m, activation,
                                                   alpha, beta, requant, out)
    _lib.kiln_qgemm(w.code, m, w.n, w.k, codes.data_ptr(), codes.stride(0), int(a_zero),
                    w.packed.data_ptr(), w.colsum.data_ptr(), float(a_scale), ws.data_ptr(),
                    ws.numel(), None if bias is None else bias.data_ptr(),
                    None if r is None else r.data_ptr(), ldr, act, ctypes.addressof(ep),
                    y.data_ptr(), y.stride(0), torch.get_num_threads())
    return y


def qgemm_int32(codes: torch.Tensor, a_zero: int, w: QGemmWeight) -> torch.Tensor:
    """``codes @ wq - a_zero * colsum(wq)`` as int32 [M, N] (MatMulInteger's result, exact) of
    uint8 ``codes`` [M, K] with contiguous rows and a packed int8 weight (qgemm.c)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != w.k or \
            codes.stride(1) != 1:
        raise ValueError(f"qgemm_int32: expected uint8 codes [M, {w.k}] with contiguous rows, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    m = codes.shape[0]
    y = torch.empty(m, w.n, dtype=torch.int32)
    one = torch.ones(1)
    ep = (ctypes.c_float * 6)()
    _lib.kiln_qgemm(w.code, m, w.n, w.k, codes.data_ptr(), codes.stride(0), int(a_zero),
                    w.packed.data_ptr(), w.colsum.data_ptr(), 1.0, one.data_ptr(), 1, None,
                    None, 0, QACT_INT32, ctypes.addressof(ep), y.data_ptr(), w.n,
                    torch.get_num_threads())
    return y


def qgemm_f32(x: torch.Tensor, x_scale: float, x_zero: int, w: QGemmWeight,
              w_scale: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, activation: str = "", alpha=None,
              beta=None, requant: tuple | None = None,
              out: torch.Tensor | None = None, col_off: int = 0) -> torch.Tensor:
    """:func:`qgemm` of float32 rows ``x`` [M, K] (rows contiguous) quantized to uint8 in C
    first: ``clamp(round(x / x_scale) + x_zero, 0, 255)`` (QuantizeLinear), or where
    ``x_scale`` is 0 by x's own range (DynamicQuantizeLinear, the codes of
    :func:`dynamic_quantize`). ``col_off``: the weight's integers are its int8 codes plus this
    (uint8 codes beyond int8 after their zero point: codes - 128 packed, 128 - zero here)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or \
            x.shape[1] != w.k or x.stride(1) != 1:
        raise ValueError(f"qgemm_f32: expected float32 CPU rows [M, {w.k}] with contiguous "
                         f"rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
    m = x.shape[0]
    ws, bias, r, ldr, act, ep, y = _qgemm_epilogue(w, w_scale, bias, residual, m, activation,
                                                   alpha, beta, requant, out)
    rc = _lib.kiln_qgemm_f32_off(w.code, m, w.n, w.k, x.data_ptr(), x.stride(0),
                                 float(x_scale), int(x_zero), w.packed.data_ptr(),
                                 w.colsum.data_ptr(), int(col_off), ws.data_ptr(), ws.numel(),
                                 None if bias is None else bias.data_ptr(),
                                 None if r is None else r.data_ptr(), ldr, act,
                                 ctypes.addressof(ep), y.data_ptr(), y.stride(0),
                                 torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"qgemm_f32: no memory for the {m} x {w.k} codes")
    return y


def dynamic_qgemm(x: torch.Tensor, w: QGemmWeight, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """DynamicQuantizeLinear of a contiguous float32 ``x`` [M, K] (quant.c) then :func:`qgemm`
    of its codes: onnxruntime's DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul chain."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or \
            x.dim() != 2:
        raise ValueError("dynamic_qgemm: expected a contiguous float32 CPU [M, K] tensor")
    return qgemm_f32(x, 0.0, 0, w, w_scale, bias)


def qbmm_params(a_q, b_q, y_q, mult: float) -> tuple:
    """kiln_qbmm_qdq's 13 float parameters from (scale, zero, signed) of A, B and Y and the
    requantization multiplier."""
    out = []
    for s, z, signed in (a_q, b_q):
        out += [float(s), float(z), *((-128.0, 127.0) if signed else (0.0, 255.0))]
    s, z, signed = y_q
    return (*out, float(mult), float(s), float(z),
            *((-128.0, 127.0) if signed else (0.0, 255.0)))


def qbmm_geometry(a_shape, a_strides, b_shape, b_strides):
    """(dims, A's strides, B's strides) of kiln_qbmm_qdq for A [..., M, K] @ B [..., K, N]
    given as shapes and element strides (rank 2-4, batch dims broadcast: a stride 0 for a
    size-1 dim), or None where they do not multiply so."""
    ra, rb = len(a_shape), len(b_shape)
    if not 2 <= ra <= 4 or not 2 <= rb <= 4 or a_shape[-1] != b_shape[-2]:
        return None
    ash, bsh = (1,) * (4 - ra) + tuple(a_shape), (1,) * (4 - rb) + tuple(b_shape)
    ast, bst = (0,) * (4 - ra) + tuple(a_strides), (0,) * (4 - rb) + tuple(b_strides)
    batch, sa, sb = [], [], []
    for d in range(2):
        if ash[d] != bsh[d] and 1 not in (ash[d], bsh[d]):
            return None
        batch.append(max(ash[d], bsh[d]))
        sa.append(ast[d] if ash[d] != 1 else 0)
        sb.append(bst[d] if bsh[d] != 1 else 0)
    dims = (*batch, ash[2], bsh[3], ash[3])
    return dims, (*sa, ast[2], ast[3]), (*sb, bst[2], bst[3])


def qbmm_strides(a: torch.Tensor, b: torch.Tensor):
    """:func:`qbmm_geometry` of two tensors."""
    return qbmm_geometry(tuple(a.shape), a.stride(), tuple(b.shape), b.stride())


def qbmm_path(path: str | None = None) -> int:
    """qgemm.c's path code for ``path`` (None: ``KILN_QGEMM_PATH``, else the fastest here)."""
    path = path or os.environ.get("KILN_QGEMM_PATH") or qgemm_paths()[-1]
    if path not in qgemm_paths():
        raise ValueError(f"qbmm_qdq: path {path!r} is not one this CPU runs "
                         f"({', '.join(qgemm_paths())})")
    return QGEMM_PATHS[path]


def qbmm_qdq(a: torch.Tensor, b: torch.Tensor, a_q: tuple, b_q: tuple, y_q: tuple,
             mult: float, path: str | None = None) -> torch.Tensor:
    """QDQ's ``Q(MatMul(DQ(Q(a)), DQ(Q(b))))`` dequantized, as onnxruntime's QLinearMatMul
    computes it (qgemm.c's kiln_qbmm_qdq): float32 ``a`` [..., M, K] and ``b`` [..., K, N] (any
    strides, rank 2-4, batch dims broadcast) quantized by ``a_q`` / ``b_q`` = (scale, zero,
    signed), exact int32 sums, requantized by ``mult`` (a_scale * b_scale / y_scale in
    float32) to ``y_q``'s codes, returned as their float32 values [..., M, N]. ``path``
    (scalar, avx2, vnni) forces one of qgemm.c's; default the fastest (``KILN_QGEMM_PATH``)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu" or \
            b.device.type != "cpu":
        raise ValueError(f"qbmm_qdq: expected float32 CPU operands, got {a.dtype} on "
                         f"{a.device} and {b.dtype} on {b.device}")
    geo = qbmm_strides(a, b)
    if geo is None:
        raise ValueError(f"qbmm_qdq: cannot multiply {tuple(a.shape)} by {tuple(b.shape)} "
                         "(rank 2-4, matching K, broadcasting batch dims)")
    dims, sa, sb = geo
    code = qbmm_path(path)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    y = torch.empty(*lead, dims[2], dims[3], dtype=torch.float32)
    m, n = dims[2], dims[3]
    sc = (dims[1] * m * n, m * n, n)
    L = ctypes.c_long
    rc = _lib.kiln_qbmm_qdq(code, (L * 5)(*dims), a.data_ptr(), (L * 4)(*sa),
                            b.data_ptr(), (L * 4)(*sb), y.data_ptr(), (L * 3)(*sc),
                            (ctypes.c_float * 13)(*qbmm_params(a_q, b_q, y_q, mult)),
                            torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"qbmm_qdq: no memory for {tuple(a.shape)} x {tuple(b.shape)}")
    return y


def requantize_(acc: torch.Tensor, mult: torch.Tensor, scale: float, zero: int, lo: int,
                hi: int) -> torch.Tensor:
    """In place over integer products ``acc`` [rows, cols] (contiguous float32 CPU):
    ``(clamp(round(acc * mult) + zero, lo, hi) - zero) * scale``, ``mult`` [cols] (quant.c)."""
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous() or \
            mult.dtype != torch.float32 or mult.numel() != acc.shape[1] or \
            not mult.is_contiguous():
        raise ValueError("requantize_: expected contiguous float32 acc [rows, cols], mult [cols]")
    _lib.kiln_requantize(acc.shape[0], acc.shape[1], acc.data_ptr(), mult.data_ptr(), scale,
                         float(zero), float(lo), float(hi))
    return acc


def pool2d(kind: str, x: torch.Tensor, kernel, stride, dilation, pads, out_hw) -> torch.Tensor:
    """Max (``kind="max"``) or average (``"avg_pad"``: padded positions count, ``"avg"``: they
    do not) pooling of a float32 [N, C, H, W] tensor of any strides; ``pads`` = (top, left),
    the bottom and right ones being what ``out_hw`` implies. The output has ``x``'s memory
    format (channels-last stays channels-last)."""
    n, c, h, w = x.shape
    cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    y = torch.empty((n, c, *out_hw), dtype=torch.float32,
                    memory_format=torch.channels_last if cl else torch.contiguous_format)
    g = (_L * 14)(n, c, h, w, *out_hw, *kernel, *stride, *dilation, *pads)
    _lib.kiln_pool2d(POOLS[kind], g, x.data_ptr(), (_L * 4)(*x.stride()), y.data_ptr(),
                     (_L * 4)(*y.stride()), torch.get_num_threads())
    return y


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of a float32 CPU tensor whose rows are contiguous and evenly
    strided (softmax.c); a contiguous result."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    y = torch.empty(x.shape, dtype=torch.float32)
    if rows:
        ld = x.stride(-2) if x.dim() > 1 else n
        _lib.kiln_softmax_rows(rows, n, x.data_ptr(), ld, y.data_ptr(), n,
                               torch.get_num_threads())
    return y


def _linear_taps(n_in: int, n_out: int, align_corners: bool):
    """Bilinear source taps and weights along one axis, in torch's float32 arithmetic
    (``upsample_bilinear2d``: scale in/out, or (in - 1)/(out - 1) for align_corners; the
    source ``scale * (dst + 0.5) - 0.5`` clamped at 0), so the kernel gives F.interpolate's
    values: (i0, i1 int32, w0, w1 float32) [n_out]."""
    f32 = np.float32
    dst = np.arange(n_out, dtype=f32)
    if align_corners:
        scale = f32((n_in - 1) / (n_out - 1)) if n_out > 1 else f32(0)
        src = scale * dst
    else:
        scale = f32(n_in / n_out)
        src = np.maximum(scale * (dst + f32(0.5)) - f32(0.5), f32(0))
    i0 = np.minimum(src.astype(np.int32), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1).astype(np.int32)
    w1 = (src - i0.astype(f32)).astype(f32)
    return i0, i1, (f32(1) - w1).astype(f32), w1


_TAPS: dict = {}  # (n_in, n_out, align_corners) -> the tables, as torch tensors


def resize_linear2d(x: torch.Tensor, size: tuple[int, int], align_corners: bool) -> torch.Tensor:
    """``F.interpolate(x, size, mode="bilinear", align_corners=...)`` of a float32 [N, C, H, W]
    tensor, contiguous or channels-last (the output has its memory format), in resize.c."""
    n, c, h, w = x.shape
    ho, wo = size
    # channels-last where torch's F.interpolate makes it so: NHWC strides, also when they are
    # contiguous ones too (a 1 x 1 map of a channels-last tensor)
    cl = x.is_contiguous(memory_format=torch.channels_last) and x.stride(1) < x.stride(3)
    if not cl and not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((n, c, ho, wo), dtype=torch.float32,
                    memory_format=torch.channels_last if cl else torch.contiguous_format)
    tabs = []
    for key in ((h, ho, align_corners), (w, wo, align_corners)):
        t = _TAPS.get(key)
        if t is None:
            t = _TAPS[key] = [torch.from_numpy(a) for a in _linear_taps(*key)]
        tabs.append(t)
    (y0, y1, hy0, hy1), (x0, x1, wx0, wx1) = tabs
    planes, lanes = (n, c) if cl else (n * c, 1)
    _lib.kiln_resize_linear2d(planes, h, w, lanes, ho, wo, x.data_ptr(), y.data_ptr(),
                              y0.data_ptr(), y1.data_ptr(), hy0.data_ptr(), hy1.data_ptr(),
                              x0.data_ptr(), x1.data_ptr(), wx0.data_ptr(), wx1.data_ptr(),
                              torch.get_num_threads())
    return y


class DepthwiseWeight:
    """A [C, 1, kh, kw] float32 depthwise conv weight packed [kh, kw, C] for
    :func:`depthwise_fn`."""

    def __init__(self, w: torch.Tensor):
        if w.dim() != 4 or w.shape[1] != 1 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"DepthwiseWeight: expected a float32 CPU [C, 1, kh, kw] weight, "
                             f"got {tuple(w.shape)} {w.dtype} on {w.device}")
        self.c, _, self.kh, self.kw = w.shape
        w = w.contiguous()
        self.data = _aligned(self.c * self.kh * self.kw)
        _lib.kiln_dw_pack(self.c, self.kh, self.kw, w.data_ptr(), self.data.data_ptr())


def depthwise_fn(w: DepthwiseWeight, stride, dilation, bias: torch.Tensor | None = None,
                 activation: str = "", alpha: float | None = None, beta: float | None = None):
    """A depthwise convolution, its weight, geometry and epilogue bound once: a function
    ``(x, pad, residual, out) -> out`` computing ``out = act(dwconv(x, W) + bias + residual)``
    on contiguous float32 NHWC tensors ``x`` [N, H, W, C] and ``out`` (and ``residual``, or
    None) [N, Ho, Wo, C]; ``pad`` = (top, left), the bottom and right pads being what Ho and Wo
    imply (they may differ from the top and left ones). ``.params`` holds what a native program
    record needs."""
    code, lo, hi, bp = _epilogue("depthwise", w.c, bias, activation, alpha, beta)
    c, kh, kw, wp = w.c, w.kh, w.kw, w.data.data_ptr()
    (sh, sw), (dh, dw) = stride, dilation

    def geometry(x, pad, out):
        n, h, wd, cx = x.shape
        ho, wo = out.shape[1:3]
        return (n, h, wd, c, ho, wo, kh, kw, sh, sw, dh, dw, pad[0], pad[1])

    def run(x: torch.Tensor, pad, residual: torch.Tensor | None, out: torch.Tensor):
        if (x.dim() != 4 or x.shape[3] != c or out.dim() != 4 or out.shape[0] != x.shape[0]
                or out.shape[3] != c or not x.is_contiguous() or not out.is_contiguous()
                or x.dtype != torch.float32 or out.dtype != torch.float32 or min(pad) < 0
                or (residual is not None and (residual.shape != out.shape
                                              or not residual.is_contiguous()))):
            raise ValueError(f"depthwise: x {tuple(x.shape)}, pad {pad}, out "
                             f"{tuple(out.shape)} do not fit a [{c}, 1, {kh}, {kw}] weight "
                             f"(contiguous NHWC float32)")
        g = (_L * 14)(*geometry(x, pad, out))
        _lib.kiln_depthwise(g, x.data_ptr(), wp, bp,
                            None if residual is None else residual.data_ptr(), out.data_ptr(),
                            code, lo, hi, torch.get_num_threads())
        return out
    run.keep = (w, bias)
    run.params = {"weight": w.data, "bias": bias, "act": code, "lo": lo, "hi": hi,
                  "geometry": geometry}
    return run


class ConvWeight:
    """A [K, C, kh, kw] float32 conv weight (one group) packed [kh, kw, C, K rounded up to 8]
    for :func:`conv_fn`."""

    def __init__(self, w: torch.Tensor):
        if w.dim() != 4 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"ConvWeight: expected a float32 CPU [K, C, kh, kw] weight, got "
                             f"{tuple(w.shape)} {w.dtype} on {w.device}")
        self.k, self.c, self.kh, self.kw = w.shape
        w = w.contiguous()
        self.data = _aligned(_lib.kiln_conv_packed_size(self.c, self.k, self.kh, self.kw))
        if _lib.kiln_conv_pack(self.c, self.k, self.kh, self.kw, w.data_ptr(),
                               self.data.data_ptr()) != 0:
            raise MemoryError("ConvWeight: no scratch memory for the packing")


def conv_fn(w: ConvWeight, stride, dilation, bias: torch.Tensor | None = None,
            activation: str = "", alpha: float | None = None, beta: float | None = None):
    """A direct convolution (one group), its weight, geometry and epilogue bound once: a
    function ``(x, pad, residual, out) -> out`` computing ``out = act(conv(x, W) + bias +
    residual)`` on contiguous float32 NHWC tensors ``x`` [N, H, W, C] and ``out`` (and
    ``residual``, or None) [N, Ho, Wo, K]; ``pad`` = (top, left), the bottom and right pads
    being what Ho and Wo imply."""
    code, lo, hi, bp = _epilogue("conv", w.k, bias, activation, alpha, beta)
    k, c, kh, kw, wp = w.k, w.c, w.kh, w.kw, w.data.data_ptr()
    (sh, sw), (dh, dw) = stride, dilation

    def run(x: torch.Tensor, pad, residual: torch.Tensor | None, out: torch.Tensor):
        if (x.dim() != 4 or x.shape[3] != c or out.dim() != 4 or out.shape[0] != x.shape[0]
                or out.shape[3] != k or not x.is_contiguous() or not out.is_contiguous()
                or x.dtype != torch.float32 or out.dtype != torch.float32 or min(pad) < 0
                or (residual is not None and (residual.shape != out.shape
                                              or not residual.is_contiguous()))):
            raise ValueError(f"conv: x {tuple(x.shape)}, pad {pad}, out {tuple(out.shape)} "
                             f"do not fit a [{k}, {c}, {kh}, {kw}] weight (contiguous NHWC "
                             f"float32)")
        n, h, wd, _ = x.shape
        g = (_L * 15)(n, h, wd, c, k, out.shape[1], out.shape[2], kh, kw, sh, sw, dh, dw,
                      pad[0], pad[1])
        if _lib.kiln_conv(g, x.data_ptr(), wp, bp,
                          None if residual is None else residual.data_ptr(), out.data_ptr(),
                          code, lo, hi, torch.get_num_threads()) != 0:
            raise MemoryError("conv: the kernel could not allocate its scratch memory")
        return out
    run.keep = (w, bias)
    return run


def gemm_fn(w: PackedWeight, bias: torch.Tensor | None = None, activation: str = "",
            alpha: float | None = None, beta: float | None = None):
    """:func:`gemm` with its weight, bias and epilogue bound once: a function
    ``(x, residual, out) -> out`` for the per-run path of a kernel, which checks only what can
    change between runs (x's and the residual's shapes and row strides). ``bias`` (kept alive by
    the function) must be a contiguous float32 [N]."""
    code, lo, hi, bp = _epilogue("gemm", w.n, bias, activation, alpha, beta)
    call, k, n, wp = _lib.kiln_sgemm, w.k, w.n, w.data.data_ptr()

    def run(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if x.dim() != 2 or x.shape[1] != k or k < 1 or x.stride(1) != 1 or out.shape != (m, n) \
                or out.stride(1) != 1 or (residual is not None and (
                    residual.shape != (m, n) or residual.stride(1) != 1)):
            raise ValueError(f"gemm: x {tuple(x.shape)} (strides {x.stride()}), out "
                             f"{tuple(out.shape)} do not fit a [{k}, {n}] weight with "
                             f"contiguous rows")
        rp, rs = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        call(m, n, k, x.data_ptr(), x.stride(0), wp, bp, rp, rs, out.data_ptr(), out.stride(0),
             code, lo, hi, torch.get_num_threads())
        return out
    run.keep = (w, bias)  # the packed weight and the bias stay alive with the function
    return run


# the float kernels' instruction sets (gemm.c's kiln_conv_set_isa), the widest last
CONV_ISAS = {"avx2": 1, "avx512": 2}


def conv_isas() -> list[str]:
    """The instruction sets the float GEMM, direct and depthwise conv kernels run here."""
    best = _lib.kiln_conv_isa_best()
    return [k for k, v in CONV_ISAS.items() if v <= best]


def set_conv_isa(name: str | None) -> str:
    """Make the float GEMM, direct conv and depthwise conv kernels take ``name``'s paths
    ("avx2", or "avx512" where the CPU has it; None: the best it has), process-wide, so that a
    test runs the AVX2 path on an AVX-512 machine. Returns the one in force."""
    if name is not None and name not in CONV_ISAS:
        raise ValueError(f"set_conv_isa: {name!r} is not one of {', '.join(CONV_ISAS)}")
    got = _lib.kiln_conv_set_isa(0 if name is None else CONV_ISAS[name])
    return next(k for k, v in CONV_ISAS.items() if v == got)


def _epilogue(kernel: str, n: int, bias: torch.Tensor | None, activation: str, alpha,
              beta) -> tuple[int, float, float, int | None]:
    """A kernel's epilogue arguments: (activation code, its two parameters, the bias pointer),
    the bias checked to be a contiguous float32 [n]."""
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()
                             or bias.dtype != torch.float32):
        raise ValueError(f"{kernel}: bias {tuple(bias.shape)} {bias.dtype}: expected a "
                         f"contiguous float32 [{n}]")
    lo, hi = _epilogue_params(activation, alpha, beta)
    return ACTIVATIONS[activation], lo, hi, None if bias is None else bias.data_ptr()


def _epilogue_params(activation: str, alpha, beta) -> tuple[float, float]:
    if activation == "LeakyRelu":
        return (0.01 if alpha is None else alpha), 0.0  # ONNX's default slope
    return (float("-inf") if alpha is None else alpha), (float("inf") if beta is None else beta)


available = _lib is not None
