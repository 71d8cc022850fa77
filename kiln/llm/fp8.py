"""FP8 (e4m3) weights for the CUDA LLM path: one float32 scale per output channel.

    w[n, k] ~= q[n, k] * s[n],   s[n] = max_k |w[n, k]| / 448,   q = float8_e4m3fn(w / s)

Decode at small batch streams every weight once per token, so FP8 halves the bytes of FP16. Each
GEMM of a step picks its path by the rows it has:

- up to ``triton_gemv.MAX_ROWS`` rows, with a tuned config: the Triton GEMV, which widens each FP8
  tile to float32 in registers and applies ``s`` to the sums (weight-only: x stays FP16);
- more rows (prefill, large decode batches): ``torch._scaled_mm`` on FP8 tensor cores, x
  quantized per row on the fly (x ~= qx * sx, sx = max |x| / 448);
- where ``_scaled_mm`` is missing or refuses (no FP8 tensor cores, a shape not a multiple of
  16): the weight dequantized to x's dtype for the call, then ``F.linear``.

The CPU runs the last two (torch has both there): that is how the tests check the numerics.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kiln.errors import KilnError

log = logging.getLogger("kiln.llm")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
# (device type, activation dtype) -> the output dtype _scaled_mm gives it (None: not usable);
# some builds give rowwise-scaled results only in bfloat16, cast back then
_scaled_mm_ok: dict[tuple, torch.dtype | None] = {}


class Fp8Weight:
    """A [N, K] weight as ``q`` (float8_e4m3fn [N, K]) and ``scale`` (float32 [N])."""

    __slots__ = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def clone(self) -> Fp8Weight:
        return Fp8Weight(self.q.clone(), self.scale.clone())


def quantize(w: torch.Tensor, name: str = "weight") -> Fp8Weight:
    """``w`` [N, K] (any float dtype, any device) as FP8 e4m3 with per-row scales."""
    if w.dim() != 2:
        raise KilnError(f"{name} {tuple(w.shape)}: fp8 weights need a 2-D weight")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise KilnError(f"{name}: fp8 needs finite weights")
    amax = wf.abs().amax(1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale.contiguous())


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T + bias`` without the Triton GEMV: ``_scaled_mm``, else dequantize + GEMM."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    out_dtype = _scaled_mm_usable(x.device, x.dtype) if n % 16 == 0 and k % 16 == 0 else None
    if out_dtype is not None:
        try:
            y = scaled_mm(x2, w, out_dtype).to(x.dtype)
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], n)
        except RuntimeError as e:  # an input this build's _scaled_mm refuses: dequantize
            _scaled_mm_ok[(x.device.type, x.dtype)] = None
            log.warning("torch._scaled_mm failed (%s); FP8 GEMMs dequantize to %s instead",
                        str(e)[:200], x.dtype)
    return F.linear(x, w.dequantize(x.dtype), bias)


_triton_quant = [True]  # the one-kernel activation quantize on CUDA, until it fails once


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qx float8 [M, K], sx float32 [M, 1]) with x2 ~= qx * sx, one scale per row. On CUDA one
    Triton kernel (``triton_fused.quantize_rows``: absmax, scale and cast), else torch ops
    (and on CUDA after the kernel failed once)."""
    if x2.is_cuda and _triton_quant[0] and x2.stride(-1) == 1:
        try:
            from kiln.llm import triton_fused

            return triton_fused.quantize_rows(x2)
        except Exception as e:  # no Triton, or a compile/launch failure: torch ops from now
            _triton_quant[0] = False
            log.warning("Triton FP8 activation quantize failed (%s: %s); torch ops instead",
                        type(e).__name__, str(e)[:200])
    return quantize_rows_torch(x2)


def quantize_rows_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in torch ops."""
    xf = x2.float()
    amax = xf.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / sx).clamp_(-FP8_MAX, FP8_MAX).to(FP8), sx


def scaled_mm(x2: torch.Tensor, w: Fp8Weight, out_dtype) -> torch.Tensor:
    """``x2 [M, K] @ w^T`` on FP8 tensor cores (rowwise scales on both sides)."""
    qx, sx = quantize_rows(x2)
    return torch._scaled_mm(qx, w.q.t(), scale_a=sx, scale_b=w.scale.view(1, -1),
                            out_dtype=out_dtype)


def _scaled_mm_usable(device: torch.device, dtype) -> torch.dtype | None:
    """The output dtype ``torch._scaled_mm`` with rowwise scales gives activations of ``dtype``
    here (``dtype`` itself, else bfloat16), or None where it does not run (probed once per
    device type and dtype on a 16 x 16 x 32 problem)."""
    key = (device.type, dtype)
    if key not in _scaled_mm_ok:
        _scaled_mm_ok[key] = None
        a = torch.ones(16, 32, device=device, dtype=dtype)
        probe = Fp8Weight(torch.ones(16, 32, device=device).to(FP8), torch.ones(16, device=device))
        for out in dict.fromkeys((dtype, torch.bfloat16)):
            try:
                if bool((scaled_mm(a, probe, out).float() == 32).all()):
                    _scaled_mm_ok[key] = out
                    break
            except (RuntimeError, TypeError, AttributeError, NotImplementedError) as e:
                log.info("torch._scaled_mm to %s is not usable on %s (%s: %s)", out,
                         device.type, type(e).__name__, str(e)[:200])
        if _scaled_mm_ok[key] is None:
            log.warning("torch._scaled_mm does not run on %s: FP8 GEMMs past the Triton GEMV "
                        "dequantize their weight per call", device.type)
    return _scaled_mm_ok[key]
