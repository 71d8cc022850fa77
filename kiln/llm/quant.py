"""Weight-only quantization of an LLM's linear layers (CPU): INT8 and INT4 in groups of 32.

Decode at batch 1 streams every weight once per token, so its speed is the bytes of weights per
token over the memory bandwidth. ``int8`` keeps one FP16 scale per 32 weights (1.0625 bytes per
weight: w = s * q, q in -127..127); ``int4`` one FP16 scale and one FP16 minimum per 32 (0.625
bytes per weight: w = s * q + min, q in 0..15). They are GGUF's Q8_0 and Q4_1, so a GGUF stored
in those types (SmolLM2's) quantizes back to its own values. Each output row is one record
(scales, minimums, codes: ``kiln/native/llm.c``), so a row streams from one place.

Activations stay float32: the GEMV (``kiln/native/llm.c``) unpacks each group into registers
and multiplies in float32, up to 4 rows of x per unpacked group. Rows past :data:`GEMV_ROWS`
(long prefills) run their GEMM on the weight dequantized for the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln import native
from kiln.errors import KilnError

GROUP = 32
FORMATS = {"float32": 0, "int8": 1, "int4": 2}  # the codes of kiln/native/llm.c
GEMV_ROWS = 32  # up to this many rows, the quantized GEMV (measured even at ~64); more:
# dequantize + GEMM
_FP16_MAX = 65504.0


def native_ok() -> bool:
    lib = native._lib
    return lib is not None and hasattr(lib, "kiln_llm_supported") and bool(
        lib.kiln_llm_supported())


def row_bytes(fmt: str, k: int) -> int:
    ng = k // GROUP
    return {"float32": 4 * k, "int8": 2 * ng + k, "int4": 4 * ng + k // 2}[fmt]


class QuantWeight:
    """A [N, K] weight in ``fmt`` (``int8`` or ``int4``): ``data`` uint8 [N, row bytes], each
    row its FP16 scales [K / 32], (int4) FP16 minimums [K / 32], then its codes."""

    __slots__ = ("fmt", "n", "k", "data")

    def __init__(self, fmt: str, data: torch.Tensor, n: int, k: int):
        self.fmt, self.data, self.n, self.k = fmt, data, n, k

    @property
    def code(self) -> int:
        return FORMATS[self.fmt]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def nbytes(self) -> int:
        return self.data.numel()

    def parts(self):
        """(scale [N, K/32], minimum [N, K/32] or None, codes) as float32/uint8/int8 views."""
        ng = self.k // GROUP
        scale = self.data[:, : 2 * ng].contiguous().view(torch.float16).float()
        if self.fmt == "int8":
            return scale, None, self.data[:, 2 * ng:].contiguous().view(torch.int8)
        minimum = self.data[:, 2 * ng: 4 * ng].contiguous().view(torch.float16).float()
        return scale, minimum, self.data[:, 4 * ng:]

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight this stands for."""
        if native_ok():
            out = torch.empty(self.n, self.k, dtype=torch.float32)
            native._lib.kiln_qdequant(self.code, self.n, self.k, self.data.data_ptr(),
                                      out.data_ptr(), torch.get_num_threads())
            return out
        return dequantize_reference(self)


def quantize(w: torch.Tensor, fmt: str, name: str = "weight") -> QuantWeight:
    """``w`` [N, K] float (K a multiple of 32) in ``fmt``: ``int8`` or ``int4``."""
    if fmt not in ("int8", "int4"):
        raise KilnError(f"weight format {fmt!r}: use int8 or int4")
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise KilnError(f"{name} {tuple(w.shape)}: {fmt} weights need a 2-D weight whose input "
                        f"dim is a multiple of {GROUP}")
    n, k = w.shape
    g = w.detach().float().cpu().reshape(n, k // GROUP, GROUP)
    if not bool(torch.isfinite(g).all()) or float(g.abs().max()) > _FP16_MAX:
        raise KilnError(f"{name}: {fmt} keeps FP16 scales; this weight has values that are not "
                        f"finite or beyond {_FP16_MAX:g}")

    def fp16(t):  # the scale as stored, so the codes are rounded against it
        return t.half().float()

    if fmt == "int8":
        scale = fp16(g.abs().amax(-1) / 127)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(g * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        parts = [scale.half().view(torch.uint8), q.reshape(n, k).view(torch.uint8)]
    else:
        lo = fp16(g.amin(-1))
        scale = fp16((g.amax(-1) - lo) / 15)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j low, element j + 16 high
        parts = [scale.half().view(torch.uint8), lo.half().view(torch.uint8),
                 packed.reshape(n, k // 2)]
    data = torch.cat([p.reshape(n, -1) for p in parts], dim=1).contiguous()
    return QuantWeight(fmt, data, n, k)


def dequantize_reference(w: QuantWeight) -> torch.Tensor:
    """``w`` as float32 [N, K], in torch ops (the reference for the C kernels)."""
    ng = w.k // GROUP
    scale, minimum, q = w.parts()
    if w.fmt == "int8":
        g = q.reshape(w.n, ng, GROUP).float() * scale.unsqueeze(-1)
    else:
        b = q.reshape(w.n, ng, GROUP // 2)
        g = (torch.cat([b & 15, b >> 4], dim=-1).float() * scale.unsqueeze(-1)
             + minimum.unsqueeze(-1))
    return g.reshape(w.n, w.k)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T + bias`` for a float tensor ``w`` or a :class:`QuantWeight`."""
    if not isinstance(w, QuantWeight):
        return F.linear(x, w, bias)
    rows = x.numel() // w.k
    if rows > GEMV_ROWS or not native_ok() or x.dtype != torch.float32:
        return F.linear(x, w.dequantize().to(x.dtype), bias)
    x2 = x.reshape(rows, w.k).contiguous()
    out = torch.empty(rows, w.n, dtype=torch.float32)
    native._lib.kiln_qgemv(w.code, rows, w.n, w.k, x2.data_ptr(), w.k, w.data.data_ptr(),
                           _ptr(bias), out.data_ptr(), w.n, 0, torch.get_num_threads())
    return out.reshape(*x.shape[:-1], w.n)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()
