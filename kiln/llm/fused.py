"""A decode layer's small ops, each as torch ops or as one fused Triton kernel
(``triton_fused.py``)::

    add_rms_norm   x + r -> RMSNorm * w           (the residual add and the next norm)
    silu_mul       [g | u] -> silu(g) * u          (after the merged gate|up GEMM)
    rope_kv        qkv -> RoPE(q); RoPE(k), v -> their KV-cache slots (quantized to e4m3
                   with the layer's scales where the cache is FP8); with_k: RoPE(k) too

``LlamaModel`` runs the torch functions here unless it holds a :class:`FusedOps` (the CUDA
runner gives it one; ``KILN_LLM_FUSED=0`` does not). ``FusedOps`` tries each Triton kernel and,
where one fails to compile or launch, logs it, turns that op's kernel off for good and runs the
torch op instead (``paths`` records which ran).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kiln.llm import kv_quant

log = logging.getLogger("kiln.llm")
OPS = ("add_rms_norm", "silu_mul", "rope_kv")


def add_rms_norm(x, r, w, eps):
    """(x + r, RMSNorm(x + r) * w); r None: (x, RMSNorm(x) * w)."""
    if r is not None:
        x = x + r
    return x, F.rms_norm(x, (x.shape[-1],), w, eps)


def silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x*cos + rotate_half(x)*sin, rotate_half([a, b]) = [-b, a]
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def rope_kv(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads, head_dim,
            kv_scale=None, with_k=False):
    """q [T, heads, head_dim] rotated; k rotated and v written into the flat caches
    [slots, kv_heads, head_dim] at ``slots``. cos, sin: the [max_position, head_dim] tables.
    FP8 caches: quantized with ``kv_scale`` (float32 [K scale, V scale]). ``with_k``:
    (q, the rotated k [T, kv_heads, head_dim]) instead of q."""
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k = rope(k.view(t, -1, head_dim), c, s)
    kv_quant.store(k_cache, slots, k, ks)
    kv_quant.store(v_cache, slots, v.reshape(t, -1, head_dim), vs)
    q = rope(q.view(t, -1, head_dim), c, s)
    return (q, k) if with_k else q


TORCH = {"add_rms_norm": add_rms_norm, "silu_mul": silu_mul, "rope_kv": rope_kv}


class FusedOps:
    """The Triton kernels of ``OPS``, each with the torch op above as its fallback."""

    def __init__(self, ops=OPS):
        self.on = {op: op in ops for op in OPS}
        self._kernels = None  # op -> Triton function, on first use (triton imported then)

    @property
    def paths(self) -> dict[str, str]:
        return {op: "triton" if on else "torch" for op, on in self.on.items()}

    def _run(self, op: str, *args):
        if self.on[op]:
            try:
                if self._kernels is None:
                    from kiln.llm import triton_fused as tf

                    self._kernels = {"add_rms_norm": tf.add_rms_norm, "silu_mul": tf.silu_mul,
                                     "rope_kv": tf.rope_kv}
                return self._kernels[op](*args)
            except Exception as e:  # compile/launch failure: the torch ops from now on
                log.warning("Triton %s failed (%s: %s); torch ops instead", op,
                            type(e).__name__, str(e)[:200])
                self.on[op] = False
        return TORCH[op](*args)

    def add_rms_norm(self, x, r, w, eps):
        if not x.is_contiguous() or (r is not None and not r.is_contiguous()):
            return add_rms_norm(x, r, w, eps)
        return self._run("add_rms_norm", x, r, w, eps)

    def silu_mul(self, gu):
        if not gu.is_contiguous():
            return silu_mul(gu)
        return self._run("silu_mul", gu)

    def rope_kv(self, qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads,
                head_dim, kv_scale=None, with_k=False):
        rows_ok = qkv.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        cache_ok = all(c.stride(2) == 1 and c.stride(1) == head_dim for c in (k_cache, v_cache))
        if not (rows_ok and cache_ok):
            return rope_kv(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads,
                           head_dim, kv_scale, with_k)
        return self._run("rope_kv", qkv, cos, sin, positions, slots, k_cache, v_cache, heads,
                         kv_heads, head_dim, kv_scale, with_k)
