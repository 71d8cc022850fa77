"""Weight-only quantization of an LLM's linear layers (CPU): INT8 and INT4 in groups of 32.

Decode at batch 1 streams every weight once per token, so its speed is the bytes of weights per
token over the memory bandwidth. ``int8`` keeps one float32 scale per 32 weights (1.125 bytes
per weight: w = s * q, q in -127..127); ``int4`` one scale and one minimum per 32 (0.75 bytes per
weight: w = s * q + min, q in 0..15). They are GGUF's Q8_0 and Q4_1 with float32 scales, so a
GGUF stored in those types (SmolLM2's) quantizes back to its own values.

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


def native_ok() -> bool:
    return native._lib is not None and hasattr(native._lib, "kiln_qgemv")


class QuantWeight:
    """A [N, K] weight in ``fmt`` (``int8`` or ``int4``); ``q`` the codes, ``scale`` and
    ``minimum`` (int4) float32 [N, K / 32]."""

    __slots__ = ("fmt", "n", "k", "q", "scale", "minimum")

    def __init__(self, fmt: str, q: torch.Tensor, scale: torch.Tensor,
                 minimum: torch.Tensor | None, n: int, k: int):
        self.fmt, self.q, self.scale, self.minimum, self.n, self.k = fmt, q, scale, minimum, n, k

    @property
    def code(self) -> int:
        return FORMATS[self.fmt]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minimum)
                   if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight this stands for."""
        if native_ok():
            out = torch.empty(self.n, self.k, dtype=torch.float32)
            native._lib.kiln_qdequant(self.code, self.n, self.k, self.q.data_ptr(),
                                      self.scale.data_ptr(), _ptr(self.minimum), out.data_ptr(),
                                      torch.get_num_threads())
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
    if fmt == "int8":
        scale = g.abs().amax(-1) / 127
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(g * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return QuantWeight(fmt, q.reshape(n, k).contiguous(), scale.contiguous(), None, n, k)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j low, element j + 16 high
    return QuantWeight(fmt, packed.reshape(n, k // 2).contiguous(), scale.contiguous(),
                       lo.contiguous(), n, k)


def dequantize_reference(w: QuantWeight) -> torch.Tensor:
    """``w`` as float32 [N, K], in torch ops (the reference for the C kernels)."""
    ng = w.k // GROUP
    if w.fmt == "int8":
        g = w.q.reshape(w.n, ng, GROUP).float() * w.scale.unsqueeze(-1)
    else:
        b = w.q.reshape(w.n, ng, GROUP // 2)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()
        g = q * w.scale.unsqueeze(-1) + w.minimum.unsqueeze(-1)
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
    native._lib.kiln_qgemv(w.code, rows, w.n, w.k, x2.data_ptr(), w.k, w.q.data_ptr(),
                           w.scale.data_ptr(), _ptr(w.minimum), _ptr(bias), out.data_ptr(), w.n,
                           0, torch.get_num_threads())
    return out.reshape(*x.shape[:-1], w.n)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()
