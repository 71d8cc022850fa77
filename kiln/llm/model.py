"""A Llama-architecture decoder over a paged KV cache, in torch ops (CPU and CUDA).

One step runs a flat batch of tokens from many sequences (prefill chunks and decodes mixed)::

    ids[T] -> embed -> 30 x [ RMSNorm -> QKV (one GEMM) -> RoPE -> paged attention -> O
                              + residual -> RMSNorm -> gate|up (one GEMM) -> SiLU*mul -> down
                              + residual ] -> RMSNorm -> last rows -> LM head

Q/K/V and gate/up are concatenated at load so a layer is four GEMMs. The attention backend
(``attention.py``) writes the step's K/V into the cache and attends over each sequence's blocks.

On the CPU, ``weights="int8"`` or ``"int4"`` stores the layers' GEMM weights quantized in groups
of 32 (``quant.py``; the LM head in int8 either way), and a step made only of decodes runs the
whole decoder stack in one native call (``decode_native``: ``kiln/native/llm.c``), with no
Python between the ops. ``weights="fp8"`` (for CUDA) stores every GEMM weight, the LM head
included, as FP8 e4m3 with a scale per output channel (``fp8.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.llm import fp8, fused, quant
from kiln.llm.config import ModelConfig, rope_inv_freq
from kiln.llm.quant import linear

WEIGHTS = ("dtype", "int8", "int4", "fp8")


class Layer:
    __slots__ = ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down")

    def __init__(self, sd: dict, i: int, cfg: ModelConfig, device, dtype, weights="dtype"):
        def w(name):
            return sd[f"model.layers.{i}.{name}"].to(device=device, dtype=dtype)

        self.ln1 = w("input_layernorm.weight")
        self.ln2 = w("post_attention_layernorm.weight")
        self.qkv = torch.cat([w(f"self_attn.{p}_proj.weight") for p in "qkv"]).contiguous()
        self.qkv_bias = None
        if f"model.layers.{i}.self_attn.q_proj.bias" in sd:
            self.qkv_bias = torch.cat([w(f"self_attn.{p}_proj.bias") for p in "qkv"])
        self.o = w("self_attn.o_proj.weight").contiguous()
        self.gate_up = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).contiguous()
        self.down = w("mlp.down_proj.weight").contiguous()
        for name in ("qkv", "o", "gate_up", "down") if weights != "dtype" else ():
            if weights == "fp8":
                setattr(self, name, fp8.quantize(getattr(self, name), f"layer {i} {name}"))
            else:
                setattr(self, name, quant.quantize(getattr(self, name), weights,
                                                   f"layer {i} {name}"))


class LlamaModel:
    """Weights on one device plus the step function. ``dtype`` float32 on CPU, float16 on CUDA.

    ``weights``: ``dtype`` (the GEMM weights in ``dtype``), ``int8`` / ``int4`` (CPU, float32:
    weight-only quantized, see ``quant.py``) or ``fp8`` (e4m3 with per-channel scales, see
    ``fp8.py``: made for CUDA; on the CPU its GEMMs run on weights dequantized per call).
    """

    def __init__(self, cfg: ModelConfig, sd: dict, device="cpu", dtype=torch.float32,
                 weights: str = "dtype"):
        if weights not in WEIGHTS:
            raise KilnError(f"weights {weights!r}: use one of {', '.join(WEIGHTS)}")
        if weights in ("int8", "int4") and (torch.device(device).type != "cpu"
                                            or dtype != torch.float32):
            raise KilnError(f"weights={weights} runs on the CPU in float32 (asked: {device}, "
                            f"{dtype}); use --device cpu --dtype float32")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.weights = weights
        self.embed = sd["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        self.lm_head = (self.embed if cfg.tie_embeddings
                        else sd["lm_head.weight"].to(device=device, dtype=dtype))
        if weights == "fp8":
            self.lm_head = fp8.quantize(self.lm_head, "lm_head")
            fp8._scaled_mm_usable(self.device, dtype)  # probed now, never inside a graph capture
        elif weights != "dtype":
            self.lm_head = quant.quantize(self.lm_head, "int8", "lm_head")
        self.norm = sd["model.norm.weight"].to(device=device, dtype=dtype)
        self.layers = [Layer(sd, i, cfg, device, dtype, weights) for i in range(cfg.num_layers)]
        inv, mscale = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout
        self.cos = (emb.cos() * mscale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * mscale).to(device=device, dtype=dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self._native = None  # the pointer table of decode_native, made on first use
        # (N, K) of a weight -> Triton GEMV config for one-row steps (CUDA, set by the runner)
        self.gemv: dict[tuple[int, int], tuple] = {}
        # (N, K) of a down weight -> config of the GEMV that makes silu(gate) * up itself
        self.gemv_silu: dict[tuple[int, int], tuple] = {}
        self.fused: fused.FusedOps | None = None  # fused kernels (CUDA, set by the runner)

    def _linear(self, x: torch.Tensor, w, bias=None) -> torch.Tensor:
        if isinstance(w, fp8.Fp8Weight):
            return self._linear_fp8(x, w, bias)
        if self.gemv and x.shape[0] == 1 and isinstance(w, torch.Tensor):
            cfg = self.gemv.get(tuple(w.shape))
            if cfg is not None:
                from kiln.llm import triton_gemv

                try:
                    return triton_gemv.gemv(x, w, bias, cfg)
                except Exception as e:  # compile/launch failure: cuBLAS for this shape from now
                    triton_gemv.log.warning("Triton GEMV %s %s failed (%s: %s); cuBLAS instead",
                                            tuple(w.shape), cfg, type(e).__name__, str(e)[:200])
                    self.gemv.pop(tuple(w.shape), None)
        return linear(x, w, bias)

    def _linear_fp8(self, x: torch.Tensor, w: fp8.Fp8Weight, bias) -> torch.Tensor:
        cfg = self.gemv.get(w.shape)
        if cfg is not None:
            from kiln.llm import triton_gemv

            if x.numel() // w.shape[1] <= triton_gemv.MAX_ROWS:
                try:
                    return triton_gemv.gemv(x, w.q, bias, cfg, scale=w.scale)
                except Exception as e:  # compile/launch failure: the torch FP8 path from now
                    triton_gemv.log.warning("Triton FP8 GEMV %s %s failed (%s: %s); torch "
                                            "instead", w.shape, cfg, type(e).__name__,
                                            str(e)[:200])
                    self.gemv.pop(w.shape, None)
        return fp8.linear(x, w, bias)

    def _silu_down(self, gu: torch.Tensor, w, ops) -> torch.Tensor:
        """down(silu(gate) * up): one Triton GEMV where one was picked for this shape (one row,
        the fused kernels on), else the activation kernel then the GEMM."""
        cfg = self.gemv_silu.get(tuple(w.shape)) if gu.shape[0] == 1 else None
        if cfg is not None:
            from kiln.llm import triton_gemv

            q, scale = (w.q, w.scale) if isinstance(w, fp8.Fp8Weight) else (w, None)
            try:
                return triton_gemv.gemv(gu, q, None, cfg, scale=scale, silu_mul=True)
            except Exception as e:  # compile/launch failure: the two kernels from now on
                triton_gemv.log.warning("Triton SiLU-mul GEMV %s %s failed (%s: %s); two "
                                        "kernels instead", tuple(w.shape), cfg,
                                        type(e).__name__, str(e)[:200])
                self.gemv_silu.pop(tuple(w.shape), None)
        return self._linear(ops.silu_mul(gu), w)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn, meta,
                logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Logits [rows, vocab] (float32) for ``logits_rows`` of the step's ``ids``.

        ``attn(layer_index, q, k, v, meta)`` -> [T, heads * head_dim]; ``meta`` is the
        backend's per-step metadata (slots, block tables, lengths), built once per step.
        """
        cfg = self.cfg
        hd = cfg.head_dim
        t = ids.shape[0]
        ops = self.fused or fused  # the Triton kernels with torch fallbacks, or torch ops
        x = F.embedding(ids, self.embed)
        # a backend whose step takes RoPE + the cache write as one kernel (CUDA decode)
        fuses = getattr(attn, "fuses_rope", None)
        fuse_rope = self.fused is not None and fuses is not None and fuses(meta)
        need_kv = fuse_rope and attn.needs_fresh_kv(meta)
        if not fuse_rope:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
        eps = cfg.rms_norm_eps
        res = None  # the last sublayer's output, added to x by the next norm
        for i, lay in enumerate(self.layers):
            x, y = ops.add_rms_norm(x, res, lay.ln1, eps)
            qkv = self._linear(y, lay.qkv, lay.qkv_bias)
            if fuse_rope and need_kv:  # a prefill's attention reads the fresh K/V too
                q, k = self.fused.rope_kv(qkv, self.cos, self.sin, positions, meta.slots,
                                          *attn.flat_kv(i), cfg.num_heads, cfg.num_kv_heads,
                                          hd, attn.kv_scales(i), with_k=True)
                v = qkv[:, self.q_size + self.kv_size:].view(t, -1, hd)
                o = attn.attend(i, q, meta, k, v)
            elif fuse_rope:
                q = self.fused.rope_kv(qkv, self.cos, self.sin, positions, meta.slots,
                                       *attn.flat_kv(i), cfg.num_heads, cfg.num_kv_heads, hd,
                                       attn.kv_scales(i))
                o = attn.attend(i, q, meta)
            else:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = fused.rope(q.view(t, -1, hd), cos, sin)
                k = fused.rope(k.view(t, -1, hd), cos, sin)
                o = attn(i, q, k, v.view(t, -1, hd), meta)
            x, y = ops.add_rms_norm(x, self._linear(o, lay.o), lay.ln2, eps)
            res = self._silu_down(self._linear(y, lay.gate_up), lay.down, ops)
        if logits_rows is not None:
            x = (x + res)[logits_rows]
            res = None
        _, x = ops.add_rms_norm(x, res, self.norm, eps)
        return self._linear(x, self.lm_head).float()

    def native_decode_ok(self) -> bool:
        """Whether decode steps can run as one native call (CPU, float32, the C library)."""
        return (self.device.type == "cpu" and self.dtype == torch.float32 and quant.native_ok()
                and self.cfg.head_dim % 2 == 0 and self.weights != "fp8")

    def decode_native(self, ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                      meta) -> torch.Tensor:
        """Logits [T, vocab] of a step whose T tokens are each one sequence's next token:
        the decoder stack in one call of ``kiln_llm_decode`` over ``cache``
        [layers, 2, blocks, block_size, kv_heads, head_dim] (float32)."""
        from kiln import native

        cfg, lib = self.cfg, native._lib
        t = ids.shape[0]
        if self._native is None:
            self._native = _pointer_table(self, lib)
        ptrs, fmt, keep = self._native
        x = F.embedding(ids, self.embed).contiguous()
        cos = self.cos[positions].contiguous()
        sin = self.sin[positions].contiguous()
        tables = meta.tables.contiguous()
        num_blocks, block_size = cache.shape[2], cache.shape[3]
        c = torch.tensor([t, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                          cfg.head_dim, cfg.intermediate_size, fmt, num_blocks, block_size,
                          tables.shape[1], meta.max_ctx], dtype=torch.long)
        scratch = torch.empty(lib.kiln_llm_scratch_floats(c.data_ptr()), dtype=torch.float32)
        lib.kiln_llm_decode(c.data_ptr(), ptrs.data_ptr(), x.data_ptr(), cos.data_ptr(),
                            sin.data_ptr(), cache.data_ptr(), meta.slots.data_ptr(),
                            tables.data_ptr(), meta.context_lens.data_ptr(), cfg.rms_norm_eps,
                            scratch.data_ptr(), torch.get_num_threads())
        x = F.rms_norm(x, (cfg.hidden_size,), self.norm, cfg.rms_norm_eps)
        return linear(x, self.lm_head).float()


def _pointer_table(model: LlamaModel, lib):
    """(int64 tensor of the per-layer pointers kiln_llm_decode reads, format code, tensors)."""
    keep, rows = [], []
    fmt = quant.FORMATS["float32" if model.weights == "dtype" else model.weights]

    def add(t):
        if t is None:
            return 0
        t = t.contiguous()
        keep.append(t)
        return t.data_ptr()

    def weight(w):
        return add(w.data if isinstance(w, quant.QuantWeight) else w)

    for lay in model.layers:
        row = [add(lay.ln1), add(lay.ln2), weight(lay.qkv), add(lay.qkv_bias), weight(lay.o),
               weight(lay.gate_up), weight(lay.down)]
        if len(row) != lib.kiln_llm_ptrs_per_layer():
            raise KilnError("kiln/native/llm.c expects another pointer table: rebuild kiln "
                            "(python setup.py build_ext --inplace)")
        rows += row
    return torch.tensor(rows, dtype=torch.long), fmt, keep

