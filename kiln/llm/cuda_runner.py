"""The CUDA model runner: Triton paged decode attention, SDPA prefill, CUDA graphs for decode.

Decode-only steps (every sequence adds one token) run the Triton kernel (for MHA models,
``KILN_LLM_DECODE_TILE=N`` picks its tiled variant, N tokens per iteration); a step with prefill
chunks (``MixedMeta``) runs its decode rows through the same kernel and each chunk through SDPA
(whole prompts straight to flash attention, consecutive ones of one length as one batched call;
a continued chunk over its gathered blocks). The model gets the fused kernels of ``fused.py``
(add + RMSNorm, SiLU * up, RoPE + KV write: in mixed steps too, returning the rotated K that
whole prompts attend over). Decode steps are captured once per padded batch size of
``GRAPH_SIZES`` and replayed.
A decode step's inputs are one int32 buffer (filled on the host in a pinned copy, one
host-to-device copy per step)::

    [ids[S] | positions[S] | slots[S] | lens[S] | tables[S, max_blocks]]

and the graph ends in a greedy argmax, so a greedy step copies back one token id per sequence
instead of sampling from the logits on the host side. Padding rows write into a scratch block
past the pool, with length 1.

At load, each weight shape's one-row GEMV is timed with cuBLAS (FP8 weights:
``torch._scaled_mm``) against the Triton split-K kernels of ``triton_gemv`` and the faster is
kept (``LlamaModel.gemv``).

Fallbacks (logged on ``kiln.llm``, recorded in ``paths``): a graph that fails to capture turns
graphs off (decode runs the same step eagerly); a Triton GEMV or decode kernel that fails to
compile or launch turns itself off (a GEMV shape goes back to cuBLAS; a failing decode kernel
sends decode steps to the torch path).
"""

from __future__ import annotations

import itertools
import logging
import os

import numpy as np
import torch
import torch.nn.functional as F

from kiln.llm import fp8, kv_quant
from kiln.llm.attention import TorchPagedAttention
from kiln.llm.fused import FusedOps
from kiln.llm.runner import ModelRunner
from kiln.llm.triton_attention import (
    KQ,
    PF,
    decode_splits,
    dot_tile_from_env,
    mha_tile_from_env,
    paged_decode,
)

FP8_DECODE_TILE = (128, 4)  # MHA decode over an FP8 cache: the tiled kernel (see __init__)
# what _tune_decode times: (tokens a tile, warps) of the tl.dot kernel, and of the tiled MHA one
# (H200, 7B shape, b256 x 640, `bench.llm_attention --warps 4,8 --dot-tiles 32,64,128`: FP16
# dot128:4 705 us, 89% of 4.3 TB/s, against the one-block dot's 851; FP8 dot64:4 660 us and
# tile128:4 665 against 1076; 8 warps never won)
# FP8 stayed at ~47% of the bandwidth (about FP16's time for half the bytes): the loop's
# pipelining depth (num_stages, a third number; Triton's default 3 on Hopper) is timed too
# the K . q^T variant ("kq": the widened K tile as the dot's first operand, which Hopper's MMA
# can take from registers instead of a shared-memory copy per element; unmeasured) too
DOT_CANDIDATES = ((16, 4), (32, 4), (64, 4), (128, 4), (64, 4, 2), (64, 4, 4), (128, 4, 2),
                  (64, 4, KQ), (128, 4, KQ))
# the tiled kernel with the next tile's loads issued before this tile's math ("pf") too
MHA_CANDIDATES = ((64, 4), (128, 4), (128, 4, 2), (128, 4, 4), (64, 4, PF), (128, 4, PF))

log = logging.getLogger("kiln.llm")

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def _fp8_vendor(x, q, scale):
    return fp8.linear(x, fp8.Fp8Weight(q, scale))


class DecodeMeta:
    """The decode step's tensors (static buffers when replayed in a graph)."""

    def __init__(self, slots, tables, lens):
        self.slots, self.tables, self.lens = slots, tables, lens


class MixedMeta:
    """A step with prefill chunks: every token's slot; the one-token rows (decodes) with their
    tables and lengths for the Triton kernel; per prefill chunk (first row, tokens, start
    position, its blocks on the device where it continues a cached prefix, else None); and
    ``runs``: the whole prompts (no cached prefix) as (first row, tokens, count) runs of
    ``count`` consecutive prompts of the same length, each run one batched causal attention."""

    def __init__(self, entries, block_size: int, device):
        slots, dec_rows, dec_lens, dec_tabs, self.prefills = [], [], [], [], []
        row = 0
        for start, n, table in entries:
            tab = np.asarray(table, dtype=np.int64)
            pos = np.arange(start, start + n)
            slots.append(tab[pos // block_size] * block_size + pos % block_size)
            if n == 1:
                dec_rows.append(row)
                dec_lens.append(start + 1)
                dec_tabs.append(table)
            else:
                blocks = None if start == 0 else torch.from_numpy(tab).to(device)
                self.prefills.append((row, n, start, blocks))
            row += n
        self.slots = torch.from_numpy(np.concatenate(slots)).to(device)
        self.runs = []
        for row, n, _, blocks in self.prefills:
            if blocks is not None:
                continue
            last = self.runs[-1] if self.runs else None
            if last is not None and last[1] == n and last[0] + last[1] * last[2] == row:
                self.runs[-1] = (last[0], n, last[2] + 1)
            else:
                self.runs.append((row, n, 1))
        self.dec_rows = self.dec_tables = self.dec_lens = None
        if dec_rows:
            width = max(len(t) for t in dec_tabs)
            tabs = np.zeros((len(dec_tabs), width), dtype=np.int32)
            for i, t in enumerate(dec_tabs):
                tabs[i, :len(t)] = t
            self.dec_rows = torch.tensor(dec_rows, device=device)
            self.dec_lens = torch.tensor(dec_lens, dtype=torch.int32, device=device)
            self.dec_tables = torch.from_numpy(tabs).to(device)


class CudaAttention:
    def __init__(self, cache: torch.Tensor, num_heads: int,
                 scales: kv_quant.KVScales | None = None, mha_tile=None, dot_tile=None):
        self.torch_path = TorchPagedAttention(cache, num_heads, scales)
        self.scales, self.fp8 = self.torch_path.scales, self.torch_path.fp8
        self.cache, self.num_heads = cache, num_heads
        self.scale = cache.shape[-1] ** -0.5
        self.sms = (torch.cuda.get_device_properties(cache.device).multi_processor_count
                    if cache.device.type == "cuda" else 132)
        self.mha_tile = mha_tile  # None: the tl.dot decode kernel for MHA too
        self.dot_tile = dot_tile  # the tl.dot kernel's (tokens, warps); None: one block, 4
        # prefill switches (on by default; bench.llm_step times each off): equal-length whole
        # prompts as one batched SDPA call; RoPE + the cache write as one kernel in mixed steps
        self.batch_prefill = True
        self.fuse_prefill_rope = True

    def __call__(self, layer, q, k, v, meta):
        if isinstance(meta, MixedMeta):
            return self._mixed(layer, q, k, v, meta)
        if not isinstance(meta, DecodeMeta):
            return self.torch_path(layer, q, k, v, meta)
        self.write(layer, k, v, meta.slots)
        return self.attend(layer, q, meta)

    def write(self, layer, k, v, slots):
        """The step's K/V into their slots (FP8: calibrated first where pending, quantized)."""
        flat_k, flat_v = self.flat_kv(layer)
        if self.fp8:
            self.scales.before_write(layer, k, v)
        kv_quant.store(flat_k, slots, k, self.torch_path.k_scale(layer))
        kv_quant.store(flat_v, slots, v, self.torch_path.v_scale(layer))

    def kv_scales(self, layer):
        """The layer's [K scale, V scale] (float32 [2] on the device) of an FP8 cache, else
        None."""
        return self.scales.t[layer] if self.fp8 else None

    def _mixed(self, layer, q, k, v, meta: MixedMeta):
        """The step's K/V into the cache, then ``_mixed_attend``."""
        self.write(layer, k, v, meta.slots)
        return self._mixed_attend(layer, q, k, v, meta)

    def _mixed_attend(self, layer, q, k, v, meta: MixedMeta):
        """Decode rows through the Triton kernel, each prefill chunk through SDPA (causal over
        its own new keys, or over its cached prefix + chunk with an offset causal mask); with
        ``batch_prefill``, each run of equal-length whole prompts as one batched causal call.
        k, v: the step's fresh K/V [T, KV, D] (read only by whole prompts; None where the step
        has none)."""
        t, heads, hd = q.shape
        o = q.new_empty(t, heads, hd)
        if meta.dec_rows is not None:
            o[meta.dec_rows] = paged_decode(q[meta.dec_rows], self.cache[layer, 0],
                                            self.cache[layer, 1], meta.dec_tables,
                                            meta.dec_lens, self.scale,
                                            self._splits(len(meta.dec_lens)),
                                            kv_scale=self.kv_scales(layer),
                                            mha_tile=self.mha_tile, dot_tile=self.dot_tile)
        if self.batch_prefill:
            for row, n, count in meta.runs:  # [count, H, n, D] views of the run's rows
                end = row + n * count
                qs, ks, vs = (x[row:end].view(count, n, x.shape[1], hd).transpose(1, 2)
                              for x in (q, k, v))
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                     enable_gqa=heads != ks.shape[1])
                o[row:end] = out.transpose(1, 2).reshape(end - row, heads, hd)
        for row, n, start, blocks in meta.prefills:
            if blocks is None and self.batch_prefill:  # in a run above
                continue
            qs = q[row:row + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if blocks is None:  # the chunk is the whole context: its fresh (unquantized) K/V
                ks, vs, mask = k[row:row + n], v[row:row + n], None
            else:  # the cached prefix + the chunk, read back (dequantized) from the cache
                ks = kv_quant.load(self.cache[layer, 0], blocks, self.torch_path.k_scale(layer),
                                   q.dtype).flatten(0, 1)[:start + n]
                vs = kv_quant.load(self.cache[layer, 1], blocks, self.torch_path.v_scale(layer),
                                   q.dtype).flatten(0, 1)[:start + n]
                keys = torch.arange(start + n, device=q.device)
                mask = keys[None, :] <= start + torch.arange(n, device=q.device)[:, None]
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            # GQA only where the heads differ: the flag keeps some SDPA kernels out
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                 is_causal=mask is None,
                                                 enable_gqa=heads != ks.shape[1])
            o[row:row + n] = out[0].transpose(0, 1)
        return o.reshape(t, -1)

    def fuses_rope(self, meta) -> bool:
        """Decode steps, and mixed steps with ``fuse_prefill_rope``, take RoPE + the cache
        write as one kernel (``fused.rope_kv``), then ``attend`` (not while FP8 scales wait for
        calibration: ``write`` does that)."""
        kind = isinstance(meta, DecodeMeta) or (isinstance(meta, MixedMeta)
                                                and self.fuse_prefill_rope)
        return kind and not (self.fp8 and self.scales.calibrating)

    def needs_fresh_kv(self, meta) -> bool:
        """Whether ``attend`` reads the step's rotated K and V (a mixed step with a whole
        prompt: it attends over them unquantized), so the fused kernel returns K too."""
        return isinstance(meta, MixedMeta) and bool(meta.runs)

    def flat_kv(self, layer):
        """The layer's K and V caches as [slots, kv_heads, head_dim] views."""
        kc, vc = self.cache[layer, 0], self.cache[layer, 1]
        return kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])

    def attend(self, layer, q, meta, k=None, v=None):
        """Attention of a step whose K/V are in the cache already; a mixed step's whole
        prompts read their fresh ``k``, ``v`` [T, KV, D] (see ``needs_fresh_kv``)."""
        if isinstance(meta, MixedMeta):
            return self._mixed_attend(layer, q, k, v, meta)
        o = paged_decode(q, self.cache[layer, 0], self.cache[layer, 1], meta.tables, meta.lens,
                         self.scale, self._splits(q.shape[0]), kv_scale=self.kv_scales(layer),
                         mha_tile=self.mha_tile, dot_tile=self.dot_tile)
        return o.reshape(q.shape[0], -1)

    def _splits(self, batch: int) -> int:
        return decode_splits(batch, self.cache.shape[-2], self.sms)


class _Step:
    """One padded batch size's input buffers (host and device) and outputs (graph or eager)."""

    def __init__(self, size: int, width: int, scratch_slot: int, scratch_block: int, device):
        self.size, self.width = size, width
        n = 4 * size + size * width
        self.template = np.empty(n, dtype=np.int32)
        self.template[:2 * size] = 0
        self.template[2 * size:3 * size] = scratch_slot
        self.template[3 * size:4 * size] = 1
        self.template[4 * size:] = scratch_block
        pin = device.type == "cuda"
        self.host = torch.from_numpy(self.template.copy())
        if pin:
            self.host = self.host.pin_memory()
        self.arr = self.host.numpy()
        self.dev = self.host.to(device) if pin else self.host.clone()
        self.graph = None
        self.logits = self.tokens = None
        self.tokens_host = None  # pinned copy of the tokens (CUDA), made on first use
        self.rows = []  # each row's block table as the device buffer holds it (the last fill)


class _Ahead:
    """A decode step launched before the engine asked for it: what it predicted."""

    __slots__ = ("step", "b", "rids", "starts", "tables", "ids")

    def __init__(self, step: _Step, b: int, rids: list[str], entries, tables):
        self.step, self.b, self.rids = step, b, rids
        self.starts = [start + 1 for start, _, _ in entries]
        self.tables = tables  # as the device buffer holds them
        self.ids = None  # the tokens the launching step sampled (its successor's ids)

    def matches(self, ids, entries, rids) -> bool:
        """Whether the engine's step is the one launched: the same requests in the same
        order, each at the next position with the ids sampled, and tables that the device's
        begin (the blocks a step reads and writes are in those, see _can_look_ahead)."""
        if rids != self.rids or ids != self.ids:
            return False
        for (start, _, table), s0, t0 in zip(entries, self.starts, self.tables):
            if start != s0 or table[:len(t0)] != t0:
                return False
        return True


class CudaModelRunner(ModelRunner):
    def __init__(self, model, num_blocks: int, block_size: int, cuda_graphs: bool = True,
                 max_batch: int = 256, max_model_len: int | None = None,
                 tune_gemv: bool | None = None, fused_ops: bool | None = None,
                 kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
                 decode_tile: int | tuple[int, int] | None = None,
                 dot_tile: int | tuple[int, int] | None = None,
                 tune_decode: bool | None = None, lookahead: bool | None = None):
        # MHA decode in the tiled kernel: (tokens, warps), from KILN_LLM_DECODE_TILE unless
        # given (0: the tl.dot kernel); the tl.dot kernel's tile from KILN_LLM_DECODE_DOT_TILE
        # unless given; read before super() makes the attention backend.
        # Default: the tiled kernel at (128, 4) over an FP8 cache, the tl.dot kernel over FP16
        # (H200, Llama-2-7B shape, b256 x 640 tokens, `python -m bench.llm_attention --warps
        # 4,8`: FP16 dot 750 us against tile128:4 782 us; FP8 dot 1008 us against 629 us);
        # on a GPU, _tune_decode then times the candidates once at load unless one was set.
        chosen = [decode_tile is not None, dot_tile is not None,
                  os.environ.get("KILN_LLM_DECODE_TILE") is not None,
                  os.environ.get("KILN_LLM_DECODE_DOT_TILE") is not None]
        if decode_tile is None and os.environ.get("KILN_LLM_DECODE_TILE") is None:
            fp8_kv = kv_quant.resolve(kv_cache_dtype, model.dtype) == kv_quant.FP8
            decode_tile = FP8_DECODE_TILE if fp8_kv else 0
        self.decode_tile = mha_tile_from_env() if decode_tile is None else (decode_tile or None)
        self.dot_tile = dot_tile_from_env() if dot_tile is None else dot_tile
        # one more block than the pool: the scratch block that padding rows write into
        super().__init__(model, num_blocks + 1, block_size, kv_cache_dtype=kv_cache_dtype,
                         calculate_kv_scales=calculate_kv_scales)
        self.num_blocks = num_blocks
        self.scratch = num_blocks
        self.max_batch = max(max_batch, 1)
        self.max_blocks = -(-(max_model_len or model.cfg.max_position) // block_size)
        self.sizes = [s for s in GRAPH_SIZES if s <= max(max_batch, 1)] if cuda_graphs else []
        self.steps: dict[int, _Step] = {}
        self.graphs: dict[int, _Step] = {}  # the captured ones
        self.pool = None
        self.triton_decode = True
        self.paths = {"decode": "cuda-graph" if self.sizes else "eager-triton", "gemv": {}}
        # greedy decode steps launch the next step before the engine asks (see _greedy_decode)
        if lookahead is None:
            lookahead = os.environ.get("KILN_LLM_LOOKAHEAD") != "0"
        self.lookahead = lookahead
        self.ahead_stats = {"hits": 0, "misses": 0, "launched": 0}
        self._ahead: _Ahead | None = None
        if tune_gemv is None:
            tune_gemv = (model.device.type == "cuda" and os.environ.get("KILN_LLM_GEMV") != "0"
                         and model.weights in ("dtype", "fp8"))
        if fused_ops is None:
            fused_ops = model.device.type == "cuda" and os.environ.get("KILN_LLM_FUSED") != "0"
        model.fused = FusedOps() if fused_ops else None
        if tune_gemv:
            self._tune_gemv()
        if tune_decode is None:
            tune_decode = (model.device.type == "cuda"
                           and os.environ.get("KILN_LLM_DECODE_TUNE") != "0")
            if tune_decode and any(chosen):
                tune_decode = False
                self.decode_tune = "off: a decode tile was given (argument or KILN_LLM_DECODE_" \
                                   "TILE / KILN_LLM_DECODE_DOT_TILE)"
        self.decode_tune = getattr(self, "decode_tune", "off")
        if tune_decode:
            try:
                self._tune_decode()
            except Exception as e:  # the tuning is an optimization: the defaults stay
                log.warning("decode kernel tuning failed (%s: %s); defaults kept",
                            type(e).__name__, str(e)[:200])
                self.decode_tune = f"error: {type(e).__name__}"

    def _make_attention(self):
        return CudaAttention(self.cache, self.model.cfg.num_heads, self.kv_scales,
                             self.decode_tile, self.dot_tile)

    # --- load-time choices ---------------------------------------------------------------

    def _tune_gemv(self):
        m = self.model
        lay = m.layers[0]
        shapes = {"qkv": lay.qkv, "o": lay.o, "gate_up": lay.gate_up, "down": lay.down,
                  "lm_head": m.lm_head}
        try:
            from kiln.llm.triton_gemv import pick

            for name, w in shapes.items():
                # down's input is silu(gate) * up: with the fused kernels on, the GEMV that
                # makes it in registers competes against the separate kernel + the GEMV
                act = name == "down" and m.fused is not None
                if isinstance(w, fp8.Fp8Weight):  # against _scaled_mm (or dequantize + cuBLAS)
                    cfg = pick(w.q, name, w.scale, _fp8_vendor, m.dtype, silu_mul=act)
                    vendor = "torch-fp8"
                else:
                    cfg, vendor = pick(w, name, silu_mul=act), "cublas"
                cfg, fused = cfg if act else (cfg, None)
                self.paths["gemv"][name] = vendor if cfg is None else f"triton{cfg}"
                if cfg is not None:
                    m.gemv[tuple(w.shape)] = cfg
                if fused is not None:
                    self.paths["gemv"]["silu_mul+down"] = f"triton{fused}"
                    m.gemv_silu[tuple(w.shape)] = fused
        except Exception as e:  # no Triton at all, or the timing failed: cuBLAS everywhere
            log.warning("GEMV tuning failed (%s: %s); cuBLAS for every shape",
                        type(e).__name__, str(e)[:200])
            m.gemv.clear()
            m.gemv_silu.clear()
            self.paths["gemv"] = {"error": f"{type(e).__name__}"}
        log.info("kiln.llm CUDA gemv choices: %s", self.paths["gemv"])

    def decode_candidates(self) -> list[tuple[str, tuple | None, tuple | None]]:
        """(name, mha_tile, dot_tile) of the decode kernel configurations _tune_decode times:
        the tl.dot kernel at 16 to 128 tokens a tile, and for MHA models the tiled kernel."""
        def name(kind, c):
            tail = ""
            if c[-1] == KQ:  # the K . q^T variant of the tl.dot kernel
                kind, c = "kq", c[:-1]
            elif c[-1] == PF:  # the tiled kernel, next tile prefetched
                tail, c = ":pf", c[:-1]
            return f"{kind}{c[0]}:{c[1]}" + (f":s{c[2]}" if len(c) > 2 else "") + tail
        out = [(name("dot", c), None, c) for c in DOT_CANDIDATES]
        cfg = self.model.cfg
        if cfg.num_heads == cfg.num_kv_heads:
            out += [(name("tile", c), c, None) for c in MHA_CANDIDATES]
        return out

    def _tune_decode(self, batch: int | None = None, ctx: int | None = None,
                     candidates=None, iters: int = 10, warmup: int = 3, clock=None):
        """Time each decode kernel configuration once, on layer 0 of the real cache (blocks
        picked at random from the pool, no memory taken), at ``batch`` sequences (default the
        largest graph batch, at most 256) of ``ctx`` cached tokens (default 640, within
        max_model_len), and keep the fastest for every decode step from now on (its graphs
        are captured later). The timings go to ``describe()["decode_tune"]``; a candidate that
        fails is a row there; none that runs leaves the defaults. ``clock``: a wall clock
        to time with instead of CUDA events (tests)."""
        import time

        attn, cfg, bs = self.attn, self.model.cfg, self.block_size
        dev = self.model.device
        ctx = max(1, min(ctx or 640, self.max_blocks * bs))
        per = -(-ctx // bs)
        b = max(1, min(batch or min(self.max_batch, 256), self.num_blocks // per))
        ctx = min(ctx, per * bs)
        g = torch.Generator().manual_seed(0)
        tables = torch.randperm(self.num_blocks, generator=g)[:b * per].view(b, per)
        tables = tables.to(device=dev, dtype=torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(b, cfg.num_heads, cfg.head_dim, generator=g).to(dev, self.model.dtype)
        kc, vc = self.cache[0, 0], self.cache[0, 1]
        splits, scale = attn._splits(b), attn.scale
        cuda = dev.type == "cuda" and clock is None
        clock = clock or time.perf_counter
        results, best = {}, None
        for name, mha_tile, dot_tile in candidates or self.decode_candidates():
            def call(mt=mha_tile, dt=dot_tile):
                return paged_decode(q, kc, vc, tables, lens, scale, splits,
                                    kv_scale=attn.kv_scales(0), mha_tile=mt, dot_tile=dt)
            try:
                for _ in range(warmup):
                    call()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    start.record()
                    for _ in range(iters):
                        call()
                    end.record()
                    end.synchronize()
                    us = start.elapsed_time(end) * 1e3 / iters
                else:
                    t0 = clock()
                    for _ in range(iters):
                        call()
                    us = (clock() - t0) * 1e6 / iters
            except Exception as e:  # a configuration that fails to compile or launch: a row
                results[name] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            results[name] = round(us, 1)
            if best is None or us < best[0]:
                best = (us, name, mha_tile, dot_tile)
        if best is None:
            log.warning("decode kernel tuning: no configuration ran (%s); defaults kept", results)
            self.decode_tune = {"batch": b, "ctx": ctx, "us": results, "picked": None}
            return
        _, name, attn.mha_tile, attn.dot_tile = best
        self.decode_tile, self.dot_tile = attn.mha_tile, attn.dot_tile
        self.decode_tune = {"batch": b, "ctx": ctx, "us": results, "picked": name}
        log.info("kiln.llm decode kernel: %s (b%d x %d tokens: %s)", name, b, ctx, results)

    # --- the step ------------------------------------------------------------------------

    def _decode_only(self, entries, rows) -> bool:
        # FP8 scales still to calibrate: the step goes through _mixed (its write calibrates),
        # never into a graph
        calibrating = self.kv_scales is not None and self.kv_scales.calibrating
        return self.triton_decode and not calibrating and all(n == 1 for _, n, _ in entries)

    def forward(self, ids, positions, entries, rows):
        if self._decode_only(entries, rows):
            out = self._decode_safe(ids, positions, entries)
            if out is not None:
                logits = out[0]
                if rows != list(range(len(entries))):  # a 1-token prefill chunk does not sample
                    logits = logits[torch.tensor(rows, device=logits.device)]
                return logits
        if self.triton_decode:
            try:
                return self._mixed(ids, positions, entries, rows)
            except Exception as e:  # the same K/V slots are written again by the torch path
                log.warning("Triton decode in a mixed step failed (%s: %s); the torch path "
                            "from now on", type(e).__name__, str(e)[:200])
                self.triton_decode = False
                self.paths["decode"] = "torch"
                self._drop_graphs()
        return super().forward(ids, positions, entries, rows)

    def _mixed(self, ids, positions, entries, rows):
        """A step with prefill chunks: the decode rows in it still take the Triton kernel
        (``MixedMeta``), instead of padding every sequence to the longest chunk for SDPA."""
        dev = self.model.device
        meta = MixedMeta(entries, self.block_size, dev)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        rows_t = torch.tensor(rows or [0], dtype=torch.long, device=dev)
        return self.model.forward(ids_t, pos_t, self.attn, meta, rows_t)

    def forward_sample(self, ids, positions, entries, rows, sampling):
        greedy = sampling and all(r.params.greedy and not r.params.penalized for r in sampling)
        if greedy and rows == list(range(len(entries))) and self._decode_only(entries, rows):
            toks = self._greedy_decode(ids, positions, entries, sampling)
            if toks is not None:
                return toks
        if self._ahead is not None:  # a step launched ahead that this one is not: unused
            self.ahead_stats["misses"] += 1
            self._ahead = None
        return super().forward_sample(ids, positions, entries, rows, sampling)

    def _greedy_decode(self, ids, positions, entries, sampling) -> list[int] | None:
        """A greedy decode step's tokens (the in-graph argmax: one id per sequence comes
        back), or None where the Triton path failed (the caller runs the torch path).

        Lookahead: after launching this step (N), the runner launches N + 1 on the device
        before returning N's tokens, with N + 1's inputs made there from N's (each row's
        argmax as its next id, position and length + 1, the slot from its table), so the GPU
        runs N + 1 while the host updates the scheduler, detokenizes and schedules. When the
        engine then asks for N + 1 and it is the step predicted (the same requests in the same
        order, each one token on, the ids N sampled, the same tables), its tokens are already
        under way; any other step is launched as usual after it on the same stream. A step
        launched ahead and not used only wrote K/V at one position past each of its requests'
        tokens, in blocks they held and had not filled (so never a prefix-cached block);
        whoever writes that slot next does so later on the stream. Not launched where a row's
        next position needs a block its table lacks, or a request reaches max_tokens now."""
        ahead, self._ahead = self._ahead, None
        rids = [r.request_id for r in sampling]
        if ahead is not None and ahead.matches(ids, entries, rids):
            step, b = ahead.step, ahead.b
            self.ahead_stats["hits"] += 1
            self._launched()
        else:
            if ahead is not None:
                self.ahead_stats["misses"] += 1
            try:
                step, b = self._decode_step(ids, positions, entries)
            except Exception as e:
                self._decode_failed(e)
                return None
            self._launched()
        host, event = self._tokens_to_host(step, b)
        if self.lookahead and self._can_look_ahead(step, entries, sampling):
            try:
                self._advance(step, b)
                self._launch(step)
                self._ahead = _Ahead(step, b, rids, entries, step.rows)
                self.ahead_stats["launched"] += 1
            except Exception as e:  # launching ahead is an optimization: off from now on
                log.warning("decode lookahead failed (%s: %s); off", type(e).__name__,
                            str(e)[:200])
                self.lookahead = False
                self._ahead = None
        if event is not None:
            event.synchronize()
        toks = host[:b].tolist()
        if self._ahead is not None:
            self._ahead.ids = toks
        return toks

    def _can_look_ahead(self, step: _Step, entries, sampling) -> bool:
        """Whether the next step can be made on the device: no request ends with this one,
        and every row's next position lies in a block of its table as the device buffer holds
        it (filled at the last miss; a hit leaves it as it was)."""
        bs, limit = self.block_size, self.model.cfg.max_position
        if any(len(r.output_token_ids) + 1 >= r.params.max_tokens for r in sampling):
            return False  # the batch changes at the next step
        return len(step.rows) == len(entries) and all(
            (start + 1) // bs < len(table) and start + 1 < limit
            for (start, _, _), table in zip(entries, step.rows))

    def _tokens_to_host(self, step: _Step, b: int):
        """(a host tensor that holds, or will hold, the step's b tokens; the CUDA event
        after which it does, or None)."""
        if step.dev.device.type != "cuda":
            return step.tokens[:b].clone(), None
        if step.tokens_host is None:
            step.tokens_host = torch.empty(step.size, dtype=torch.long, pin_memory=True)
        step.tokens_host[:b].copy_(step.tokens[:b], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return step.tokens_host, ev

    def _advance(self, step: _Step, b: int):
        """The step's device inputs one token on, made on the device: rows < b take their
        argmax as the next id, position and length + 1, the new position's slot from the
        table (padding rows stay as they are)."""
        s, bs, buf = step.size, self.block_size, step.dev
        buf[:b].copy_(step.tokens[:b])
        buf[s:s + b] += 1
        buf[3 * s:3 * s + b] += 1
        pos = buf[s:s + b].long()
        tables = buf[4 * s:].view(s, step.width)[:b]
        blk = tables.gather(1, (pos // bs)[:, None])[:, 0].long()
        buf[2 * s:2 * s + b] = (blk * bs + pos % bs).to(buf.dtype)

    def _launch(self, step: _Step):
        """Run the step on its device buffer: the graph, or the body eagerly."""
        if step.graph is not None:
            step.graph.replay()
        else:
            step.logits, step.tokens = self._body(step)

    def _decode_safe(self, ids, positions, entries):
        """(logits [b, V], tokens [b]) of a decode step, or None where the Triton path failed
        (then it is off for good and the caller runs the torch path)."""
        try:
            return self._decode(ids, positions, entries)
        except Exception as e:
            self._decode_failed(e)
            return None

    def _decode_failed(self, e: Exception):
        log.warning("Triton decode failed (%s: %s); decode runs the torch path",
                    type(e).__name__, str(e)[:200])
        self.triton_decode = False
        self.paths["decode"] = "torch"
        self._drop_graphs()

    def _drop_graphs(self):
        self.steps.clear()
        self.graphs.clear()
        self.sizes = []
        self.pool = None
        self._ahead = None

    def _decode(self, ids, positions, entries):
        step, b = self._decode_step(ids, positions, entries)
        return step.logits[:b], step.tokens[:b]

    def _decode_step(self, ids, positions, entries) -> tuple[_Step, int]:
        """Fill a decode step's inputs and launch it: (the step, its rows); the results land
        in step.logits / step.tokens. A step launched ahead is dropped: this one may take its
        buffers (a benchmark's own _decode calls between engine steps)."""
        if self._ahead is not None:
            self.ahead_stats["misses"] += 1
            self._ahead = None
        b = len(entries)
        width = max(len(t) for _, _, t in entries)
        size = next((s for s in self.sizes if s >= b), None)
        if size is None or width > self.max_blocks:  # past the graph ladder: eager, unpadded
            step = self._make_step(b, max(width, 1))
            self._fill(step, ids, positions, entries)
            self._launch(step)
            return step, b
        step = self.steps.get(size)
        if step is None:
            step = self.steps[size] = self._make_step(size, self.max_blocks)
        self._fill(step, ids, positions, entries)
        if step.graph is None and size not in self.graphs:
            self._capture(step)
        self._launch(step)
        return step, b

    def _make_step(self, size, width):
        return _Step(size, width, self.scratch * self.block_size, self.scratch, self.model.device)

    def _fill(self, step: _Step, ids, positions, entries):
        s, w, bs, a = step.size, step.width, self.block_size, step.arr
        b = len(entries)
        step.rows = [e[2] for e in entries]
        np.copyto(a, step.template)
        if b <= 16:  # few rows: a Python loop beats numpy's per-call cost
            for i, ((start, _, table), tok, p) in enumerate(zip(entries, ids, positions)):
                a[i] = tok
                a[s + i] = p
                a[2 * s + i] = table[start // bs] * bs + start % bs
                a[3 * s + i] = start + 1
                o = 4 * s + i * w
                a[o:o + len(table)] = table
            step.dev.copy_(step.host, non_blocking=True)
            return
        starts = np.fromiter((e[0] for e in entries), np.int64, count=b)
        tabs = [e[2] for e in entries]
        counts = np.fromiter((len(t) for t in tabs), np.int64, count=b)
        flat = np.fromiter(itertools.chain.from_iterable(tabs), np.int64, count=int(counts.sum()))
        first = np.cumsum(counts) - counts  # where each table starts in flat
        a[:b] = ids
        a[s:s + b] = positions
        a[2 * s:2 * s + b] = flat[first + starts // bs] * bs + starts % bs
        a[3 * s:3 * s + b] = starts + 1
        # row i's table goes to 4s + i * w + j
        dest = np.repeat(4 * s + np.arange(b) * w - first, counts) + np.arange(flat.size)
        a[dest] = flat
        step.dev.copy_(step.host, non_blocking=True)

    def _body(self, step: _Step):
        """The decode step on the device buffer: (logits [S, V] float32, greedy tokens [S])."""
        s, buf = step.size, step.dev
        idx = buf[:3 * s].long()  # embedding rows, RoPE rows, cache slots
        ids, pos, slots = idx[:s], idx[s:2 * s], idx[2 * s:]
        lens = buf[3 * s:4 * s]
        tables = buf[4 * s:].view(s, step.width)
        meta = DecodeMeta(slots, tables, lens)
        logits = self.model.forward(ids, pos, self.attn, meta, None)
        return logits, logits.argmax(-1)

    def _capture(self, step: _Step):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # a kernel failure here reaches _decode_safe
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._body(step)
        torch.cuda.current_stream().wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step.logits, step.tokens = self._body(step)
            self.pool = graph.pool()
            step.graph = graph
            self.graphs[step.size] = step
        except Exception as e:
            log.warning("CUDA graph capture at batch %d failed (%s: %s); decode runs eagerly",
                        step.size, type(e).__name__, str(e)[:200])
            torch.cuda.synchronize()
            self.sizes = []
            self.paths["decode"] = "eager-triton"

    @torch.inference_mode()
    def warmup(self, max_tokens: int = 0):
        """Compile and capture now instead of inside the first requests' steps: four mixed
        steps (two whole prompts of a block each beside 2 or 20 decode rows, tables 16 or 17
        blocks wide: the batched SDPA, the fused RoPE + KV write that returns K, the decode
        kernel's compiled variants); with ``max_tokens`` (the engine's token budget), one
        step of that many prompt tokens (prompts of up to 512, so the large-M GEMM and SDPA
        kernels load now, not in the first full prefill step); then every graph size. All of
        it writes only into the scratch block (prompt tokens past its length share its slots:
        their attention reads the step's fresh K/V, not the cache). Not while FP8 scales wait
        for the first step's K/V (the warm-up would calibrate them on made-up tokens)."""
        if self.kv_scales is not None and self.kv_scales.calibrating:
            return
        bs = self.block_size
        # Triton compiles a kernel again where an integer argument changes class (1, a
        # multiple of 16, any other): the decode rows' table width and the splits (1 from
        # 17 rows on for 32 KV heads) take each class the engine's mixed steps meet
        for width, decodes in itertools.product((16, 17), (2, 20)):
            if not self.triton_decode:
                break
            tab = [self.scratch] * width  # every row reads and writes the scratch block only
            entries = [(0, bs, tab), (0, bs, tab)]
            entries += [(i % (bs - 1), 1, tab) for i in range(decodes)]
            ids = [0] * (2 * bs + decodes)
            positions = [*range(bs), *range(bs), *(i % (bs - 1) for i in range(decodes))]
            rows = [bs - 1, 2 * bs - 1, *range(2 * bs, 2 * bs + decodes)]
            try:
                self._mixed(ids, positions, entries, rows)
            except Exception as e:  # the first real mixed step falls back the same way
                log.warning("warm-up mixed step failed (%s: %s)", type(e).__name__,
                            str(e)[:200])
                break
        n = min(512, self.max_blocks * bs)
        count = max_tokens // n if n > 1 else 0
        if self.triton_decode and count:
            tab = [self.scratch] * -(-n // bs)
            try:
                self._mixed([0] * (n * count), [p for _ in range(count) for p in range(n)],
                            [(0, n, tab)] * count, [(i + 1) * n - 1 for i in range(count)])
            except Exception as e:
                log.warning("warm-up prefill step failed (%s: %s)", type(e).__name__,
                            str(e)[:200])
        for s in list(self.sizes):
            if not self.sizes:  # a capture failed: graphs are off, decode runs eagerly
                break
            if s not in self.graphs:
                step = self.steps.setdefault(s, self._make_step(s, self.max_blocks))
                try:
                    self._capture(step)
                except Exception as e:  # a kernel failing in the warm-up runs: as _decode_safe
                    log.warning("Triton decode failed in the warm-up (%s: %s); decode runs the "
                                "torch path", type(e).__name__, str(e)[:200])
                    self.triton_decode = False
                    self.paths["decode"] = "torch"
                    self._drop_graphs()
                    break

    def describe(self) -> dict:
        """Which paths the runner took (for benchmark rows)."""
        fused = self.model.fused.paths if self.model.fused is not None else "off"
        return {"decode": self.paths["decode"], "graphs": sorted(self.graphs),
                "gemv": dict(self.paths["gemv"]), "fused": fused,
                "decode_tile": self.attn.mha_tile, "dot_tile": self.attn.dot_tile,
                "decode_tune": self.decode_tune,
                "lookahead": {"on": self.lookahead, **self.ahead_stats}, **self.describe_kv()}
