"""FP8 (e4m3) KV cache: ``kv_cache_dtype="fp8"`` stores K and V in one byte per element.

    cache = float8_e4m3fn(clamp(x / s, -448, 448)),   x ~= cache * s

with one float32 scale per layer for K and one for V (``scales`` [layers, 2]). The scales are 1.0
(vLLM's default for ``fp8_e4m3``), or, with ``calculate_kv_scales``, set from the first step's
K/V before anything is written: ``s = amax / 224`` (twice the headroom of the amax, so later
tokens up to twice the calibration prompts' largest value are not clipped). They live in a device
tensor that the kernels read, so a CUDA graph captured before calibration would still see them;
the runner keeps decode steps out of graphs until calibration is done anyway.

Writes (``store``) go through a uint8 view: torch's index_copy_ has no float8 kernel on the CPU.
Reads dequantize: the torch paths gather blocks and widen them (``load``); the Triton decode
kernel loads FP8 tiles and widens them in registers, with the K scale folded into the softmax
scale and the V scale applied to the output.
"""

from __future__ import annotations

import torch

from kiln.errors import KilnError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CALIBRATION_HEADROOM = 2.0  # calibrated s = amax * headroom / 448
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype: ``auto`` = the model's, ``fp8`` / ``fp8_e4m3`` = e4m3."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8
    hint = " (only e4m3 is supported: use fp8)" if kv_cache_dtype == "fp8_e5m2" else ""
    raise KilnError(f"kv_cache_dtype={kv_cache_dtype!r}{hint}: use one of "
                    f"{', '.join(KV_CACHE_DTYPES)}")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` / ``scale`` (a 0-d float32 tensor) as e4m3, saturated at +-448."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(c: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (c.float() * scale).to(dtype)


def store(flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
          scale: torch.Tensor | None = None):
    """``flat[slots] = x`` for a flat cache [slots, kv_heads, head_dim]; FP8 caches quantize
    with ``scale``."""
    if not is_fp8(flat):
        flat.index_copy_(0, slots, x)
        return
    q = quantize(x.reshape(-1, *flat.shape[1:]), scale)
    flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))


def load(c: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
         dtype: torch.dtype) -> torch.Tensor:
    """``c[index]`` in ``dtype`` (dequantized where ``c`` is FP8)."""
    if not is_fp8(c):
        return c[index]
    return dequantize(c.view(torch.uint8)[index].view(FP8), scale, dtype)


def calibrate(scales: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor):
    """Set ``scales[layer]`` from the amax of this step's K and V (on the device, no sync)."""
    amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
    scales[layer].copy_((amax * (CALIBRATION_HEADROOM / FP8_MAX)).clamp_(min=1e-6))


class KVScales:
    """The scales of an FP8 cache and which layers still wait for calibration."""

    def __init__(self, num_layers: int, device, calculate: bool = False):
        self.t = torch.ones(num_layers, 2, dtype=torch.float32, device=device)
        self.calculate = calculate
        self.pending = set(range(num_layers)) if calculate else set()

    @property
    def calibrating(self) -> bool:
        return bool(self.pending)

    def before_write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer in self.pending:
            calibrate(self.t, layer, k, v)
            self.pending.discard(layer)

    def k(self, layer: int) -> torch.Tensor:
        return self.t[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.t[layer, 1]

    def describe(self) -> dict:
        t = self.t.float().cpu()
        return {"k_scale": [float(t[:, 0].min()), float(t[:, 0].max())],
                "v_scale": [float(t[:, 1].min()), float(t[:, 1].max())],
                "calculated": self.calculate and not self.pending}
