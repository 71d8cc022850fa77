"""Where an LLM step's time goes on the GPU: one prefill step, one decode step, the engine's
decode step, and their parts alone, each against its physical bound.

    python -m bench.llm_step --kv-cache-dtype fp8 --json step.json    # H200, Llama-2-7B shape
    python -m bench.llm_step --weights fp8 --kv-cache-dtype fp8
    TRITON_INTERPRET=1 python -m bench.llm_step --model tiny --device cpu   # a smoke run

Parts (median of ``--iters`` calls; CUDA events on the GPU, the wall clock on the CPU):

- ``prefill``: one mixed step of ``--prompts`` fresh prompts of ``--prompt-len`` tokens (16 x 512
  = the 8192-token budget of a CUDA engine step), through ``CudaModelRunner._mixed`` as the
  engine runs it; once per prefill variant the runner has (``prefill_variants``: batched SDPA
  over equal-length prompts on/off, RoPE + cache write fused on/off);
- ``prefill_parts``: the step's GEMMs alone at its rows (every layer's four, the LM head at one
  row a prompt; FP8 weights: activation quantize + ``_scaled_mm``), the FP8 activation quantize
  alone (the one Triton kernel, and the torch ops it replaced), causal SDPA per prompt (one
  call each) against one batched call, RoPE + cache write;
- ``decode``: one decode step of ``--batch`` sequences at ``--ctx`` cached tokens: the runner's
  ``_decode`` (host fill, copy, graph replay) and the graph replay alone; its GEMMs alone at
  ``--batch`` rows and the paged decode attention alone (every layer);
- ``decode_b1``: the batch-1 decode step at ``--b1-ctx`` cached tokens (graph replay) against
  the weight-streaming bound, each weight shape's one-row GEMV alone (GB/s), the small kernels
  alone (add + RMSNorm, RoPE + KV write, attention), the rest (gaps between kernels), and the
  kernels one step launches;
- ``engine_decode``: ``--engine-seqs`` requests of ``--engine-prompt`` tokens through
  ``LLMEngine.step`` until every one has its first token, then ``--engine-steps`` decode-only
  steps timed on the wall clock, split into the runner's share and the host's (scheduler, KV
  bookkeeping, detokenizing);
- ``bound``: the same shapes' floors, weights and K/V bytes at ``--bandwidth`` and GEMM
  FLOPs at ``--flops``, and the 256 x (512 in / 256 out) throughput ceiling, prefill then
  decode and with the two fully overlapped.

The raw steps use KV blocks straight from the pool before the engine part takes any, so no
cached prefix of the engine's is touched. Tokens are random; the model's weights are seeded
random (``bench.llm.random_llama``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from bench.llm import BANDWIDTH, llama7b_shape, placeholder_tokenizer, random_llama
from bench.llm_attention import median_call_s
from kiln.llm.config import ModelConfig

FLOPS = 790e12  # H200 dense FP16/BF16 matrix rate measured on random data (KINDS.md)
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=4, head_dim=16, max_position=512, name="tiny")


class Timer:
    """Median seconds of ``fn()`` over ``iters`` calls after ``warmup``: CUDA events around
    each call on the GPU, the wall clock (after a sync) elsewhere."""

    def __init__(self, device: str, iters: int, warmup: int = 2):
        self.cuda = device == "cuda"
        self.iters, self.warmup = iters, warmup

    def __call__(self, fn) -> float:
        return median_call_s(fn, self.iters, "cuda" if self.cuda else "cpu", self.warmup)


def kv_token_bytes(cfg: ModelConfig, kv_itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize


def gemm_params(cfg: ModelConfig) -> int:
    """Weights of the layers' four GEMMs (all layers; no embedding, no LM head)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (h * (q + 2 * kv) + q * h + 2 * i * h + h * i)


def bound(cfg: ModelConfig, weight_itemsize: int, kv_itemsize: int, prompts: int,
          prompt_len: int, batch: int, ctx: int, n: int = 256, in_len: int = 512,
          out_len: int = 256, bandwidth: float = BANDWIDTH, flops: float = FLOPS) -> dict:
    """Physical floors of the measured shapes and the n x (in_len / out_len) ceiling.

    Prefill: GEMM FLOPs (2 per weight per token, the LM head at one row a prompt) plus causal
    attention (4 H D per query-key pair, half the square) at ``flops``. Decode: the weights once
    per step plus every sequence's K/V at ``bandwidth``. The throughput ceiling adds the two
    phases (prefill then decode, as a step budget that prefills every prompt before the
    decodes run alone) or takes the longer one (prefill fully overlapped with decode)."""
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    lm_head = cfg.vocab_size * cfg.hidden_size
    wbytes = cfg.weight_bytes(weight_itemsize)
    kvt = kv_token_bytes(cfg, kv_itemsize)

    def prefill_s(seqs, length):
        f = 2 * gemm_params(cfg) * seqs * length + 2 * lm_head * seqs
        return (f + attn * seqs * length * length / 2) / flops

    def decode_s(seqs, context):
        return (wbytes + seqs * context * kvt) / bandwidth

    pre = prefill_s(n, in_len)
    dec = sum(decode_s(n, in_len + j) for j in range(out_len))
    return {"bandwidth_b_s": bandwidth, "flops": flops, "weight_bytes": wbytes,
            "kv_token_bytes": kvt,
            "prefill_step_ms": prefill_s(prompts, prompt_len) * 1e3,
            "decode_step_ms": decode_s(batch, ctx) * 1e3,
            "decode_step_tok_s": batch / decode_s(batch, ctx),
            f"run_{n}x{in_len}/{out_len}": {
                "prefill_s": pre, "decode_s": dec,
                "serial_tok_s": n * out_len / (pre + dec),
                "overlapped_tok_s": n * out_len / max(pre, dec)}}


class Blocks:
    """KV blocks handed out in order from the pool (the raw steps' tables)."""

    def __init__(self, total: int):
        self.next, self.total = 0, total

    def take(self, n: int) -> list[int]:
        if self.next + n > self.total:
            raise RuntimeError(f"llm_step: {self.next + n} KV blocks needed, the pool has "
                             f"{self.total}: use a smaller --batch / --ctx / --prompts")
        got = list(range(self.next, self.next + n))
        self.next += n
        return got


def make_engine(args):
    """(engine, model config, weight itemsize) for ``--model`` on ``--device``."""
    from kiln.llm.engine import EngineConfig, LLMEngine
    from kiln.llm.model import LlamaModel

    dev = args.device
    if args.model == "7b":
        cfg, sd = llama7b_shape(dev)
        dtype = torch.float16
    else:
        cfg, dtype = TINY, torch.float32 if dev == "cpu" else torch.float16
        sd = random_llama(cfg, dev, dtype)
    model = LlamaModel(cfg, sd, dev, dtype, args.weights)
    sd.clear()
    ec = EngineConfig(device=dev, max_model_len=args.max_model_len,
                      kv_cache_dtype=args.kv_cache_dtype, memory_fraction=args.memory_fraction,
                      num_blocks=args.num_blocks)
    engine = LLMEngine.from_model(model, placeholder_tokenizer(cfg.vocab_size), cfg.name, ec)
    if dev != "cuda":  # the CUDA runner on the CPU (Triton's interpreter): a smoke run
        from kiln.llm.cuda_runner import CudaModelRunner

        engine.runner = CudaModelRunner(model, engine.runner.num_blocks, ec.block_size,
                                        cuda_graphs=False, max_model_len=args.max_model_len,
                                        kv_cache_dtype=args.kv_cache_dtype, fused_ops=True)
    return engine, cfg, 1 if args.weights == "fp8" else dtype.itemsize


def prefill_parts(runner, cfg, rows: int, prompts: int, prompt_len: int, timer) -> dict:
    """The prefill step's pieces alone, summed over the layers (milliseconds)."""
    from kiln.llm import fp8

    m = runner.model
    dev, dt = m.device, m.dtype
    lay = m.layers[0]
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)
    out = {}
    gemm = 0.0
    for name in ("qkv", "o", "gate_up", "down"):
        w = getattr(lay, name)
        x = rnd(rows, w.shape[1])
        s = timer(lambda w=w, x=x: m._linear(x, w)) * cfg.num_layers
        out[f"gemm_{name}_ms"] = s * 1e3
        gemm += s
    x = rnd(prompts, cfg.hidden_size)
    out["gemm_lm_head_ms"] = timer(lambda: m._linear(x, m.lm_head)) * 1e3
    out["gemm_total_ms"] = gemm * 1e3 + out["gemm_lm_head_ms"]
    if m.weights == "fp8":  # the activation quantize inside each FP8 GEMM, alone
        ks = [getattr(lay, n).shape[1] for n in ("qkv", "o", "gate_up", "down")]
        xs = {k: rnd(rows, k) for k in set(ks)}
        for name, fn in (("", fp8.quantize_rows), ("_torch", fp8.quantize_rows_torch)):
            q = sum(timer(lambda x=xs[k], fn=fn: fn(x)) for k in ks)
            out[f"fp8_act_quantize{name}_ms"] = q * cfg.num_layers * 1e3
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = rnd(prompts, h, prompt_len, d)
    k = rnd(prompts, kv, prompt_len, d)
    v = rnd(prompts, kv, prompt_len, d)
    gqa = h != kv

    def loop():
        for i in range(prompts):
            F.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], is_causal=True,
                                           enable_gqa=gqa)

    out["sdpa_per_prompt_ms"] = timer(loop) * cfg.num_layers * 1e3
    out["sdpa_batched_ms"] = timer(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=gqa)) * cfg.num_layers * 1e3
    # RoPE on q/k and the K/V cache write of the step's rows (the path the step takes)
    attn = runner.attn
    qkv = rnd(rows, (h + 2 * kv) * d)
    pos = torch.arange(prompt_len, device=dev).repeat(prompts)
    slots = torch.arange(rows, device=dev)
    fk, fv = attn.flat_kv(0)
    if m.fused is not None:
        from kiln.llm import triton_fused

        def rope_write():
            triton_fused.rope_kv(qkv, m.cos, m.sin, pos, slots, fk, fv, h, kv, d,
                                 attn.kv_scales(0), with_k=True)
    else:
        from kiln.llm import fused

        def rope_write():
            fused.rope_kv(qkv, m.cos, m.sin, pos, slots, fk, fv, h, kv, d, attn.kv_scales(0),
                          with_k=True)
    try:
        out["rope_kv_write_ms"] = timer(rope_write) * cfg.num_layers * 1e3
    except Exception as e:  # a diagnosis row, not the end of the run
        out["rope_kv_write_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def prefill_variants(runner) -> list[tuple[str, dict]]:
    """(name, {attribute: value}) of the runner's prefill switches worth timing against each
    other (the defaults first)."""
    attn = runner.attn
    out = [("default", {})]
    if hasattr(attn, "batch_prefill"):
        out.append(("sdpa_per_prompt", {"batch_prefill": False}))
    if hasattr(attn, "fuse_prefill_rope"):
        out.append(("rope_unfused", {"fuse_prefill_rope": False}))
    return out


def prefill_step(engine, cfg, blocks: Blocks, args, timer) -> dict:
    runner = engine.runner
    bs = runner.block_size
    rng = random.Random(0)
    n, length = args.prompts, args.prompt_len
    per = -(-length // bs)
    entries = [(0, length, blocks.take(per)) for _ in range(n)]
    ids = [rng.randrange(3, cfg.vocab_size) for _ in range(n * length)]
    positions = [p for _ in range(n) for p in range(length)]
    rows = [(i + 1) * length - 1 for i in range(n)]
    out = {"tokens": n * length, "prompts": n, "prompt_len": length}
    with torch.inference_mode():
        for name, attrs in prefill_variants(runner):
            old = {a: getattr(runner.attn, a) for a in attrs}
            for a, val in attrs.items():
                setattr(runner.attn, a, val)
            try:
                out[f"step_ms_{name}"] = timer(
                    lambda: runner._mixed(ids, positions, entries, rows)) * 1e3
            except Exception as e:
                out[f"step_ms_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                for a, val in old.items():
                    setattr(runner.attn, a, val)
        out.update(prefill_parts(runner, cfg, n * length, n, length, timer))
        out["engine_like"] = engine_like_steps(runner, cfg, blocks, args, entries, timer)
    if isinstance(out.get("step_ms_default"), float):
        known = out["gemm_total_ms"] + out["sdpa_batched_ms" if getattr(
            runner.attn, "batch_prefill", False) else "sdpa_per_prompt_ms"]
        if isinstance(out.get("rope_kv_write_ms"), float):
            known += out["rope_kv_write_ms"]
        out["rest_ms"] = out["step_ms_default"] - known  # norms, SiLU-mul, embedding, host
    return out


def engine_like_steps(runner, cfg, blocks: Blocks, args, prompts, timer) -> dict:
    """The engine's prefill-phase step, as the 256-request run has it: ``--batch`` - ``--prompts``
    decode rows (at ``--prompt-len`` + 8 cached tokens), ``--prompts`` - 1 whole prompts and the
    last prompt's second half continuing its cached first half (a chunk over gathered
    blocks); then without the chunk and without the decodes (milliseconds each)."""
    bs, length = runner.block_size, args.prompt_len
    rng = random.Random(3)
    ctx = length + 8
    d = max(args.batch - args.prompts, 0)
    decodes = [(ctx - 1, 1, blocks.take(-(-ctx // bs))) for _ in range(d)]
    half = length // 2
    chunk = [(half, length - half, prompts[-1][2])]
    out = {"decodes": d, "prompts": len(prompts) - 1, "chunk": [half, length - half]}
    for name, entries in (("all", decodes + prompts[:-1] + chunk),
                          ("no_chunk", decodes + prompts[:-1]),
                          ("no_decodes", prompts[:-1] + chunk)):
        ids, positions, rows, t = [], [], [], 0
        for start, k, _ in entries:
            ids += [rng.randrange(3, cfg.vocab_size) for _ in range(k)]
            positions += range(start, start + k)
            t += k
            rows.append(t - 1)
        try:
            out[f"{name}_ms"] = timer(
                lambda e=entries, i=ids, p=positions, r=rows: runner._mixed(i, p, e, r)) * 1e3
        except Exception as e:
            out[f"{name}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"{name}_tokens"] = t
    return out


def decode_step(engine, cfg, blocks: Blocks, args, timer) -> dict:
    from kiln.llm.cuda_runner import DecodeMeta

    runner, m = engine.runner, engine.runner.model
    bs = runner.block_size
    b, ctx = args.batch, args.ctx
    rng = random.Random(1)
    entries = [(ctx - 1, 1, blocks.take(-(-ctx // bs))) for _ in range(b)]
    ids = [rng.randrange(3, cfg.vocab_size) for _ in range(b)]
    positions = [ctx - 1] * b
    out = {"batch": b, "ctx": ctx}
    with torch.inference_mode():
        out["step_ms"] = timer(lambda: runner._decode(ids, positions, entries)) * 1e3
        size = next((s for s in runner.sizes if s >= b), None)
        step = runner.graphs.get(size)
        if step is not None:
            out["graph_replay_ms"] = timer(step.graph.replay) * 1e3
        dev, dt = m.device, m.dtype
        g = torch.Generator(device=dev).manual_seed(2)
        lay = m.layers[0]
        gemm = 0.0
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(lay, name)
            x = torch.randn(b, w.shape[1], generator=g, device=dev, dtype=dt)
            s = timer(lambda w=w, x=x: m._linear(x, w)) * cfg.num_layers
            out[f"gemm_{name}_ms"] = s * 1e3
            gemm += s
        x = torch.randn(b, cfg.hidden_size, generator=g, device=dev, dtype=dt)
        out["gemm_lm_head_ms"] = timer(lambda: m._linear(x, m.lm_head)) * 1e3
        out["gemm_total_ms"] = gemm * 1e3 + out["gemm_lm_head_ms"]
        q = torch.randn(b, cfg.num_heads, cfg.head_dim, generator=g, device=dev, dtype=dt)
        tabs = torch.tensor([t for _, _, t in entries], dtype=torch.int32, device=dev)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        meta = DecodeMeta(None, tabs, lens)
        out["attention_ms"] = timer(lambda: runner.attn.attend(0, q, meta)) * cfg.num_layers * 1e3
        total = out.get("graph_replay_ms", out["step_ms"])
        out["rest_ms"] = total - out["gemm_total_ms"] - out["attention_ms"]
        out["decode_tune"] = runner.describe().get("decode_tune")
    return out


def decode_b1(engine, cfg, blocks: Blocks, args, timer) -> dict:
    """The batch-1 decode step (``--b1-ctx`` cached tokens) and its kernels alone: per weight
    shape the one-row GEMM the model runs (the Triton GEMV picked at load, or cuBLAS; the down
    GEMV with SiLU-mul made in registers where picked), each layer's weight in turn so every
    call streams from HBM, with its GB/s and fraction of ``--bandwidth``; the small kernels
    (add + RMSNorm, RoPE + KV write, paged attention); what is left of the graph replay (the
    gaps between kernels); and the kernels one step launches (torch.profiler over one eager
    step: the graph replays the same ones)."""
    from kiln.llm import fp8

    runner, m = engine.runner, engine.runner.model
    bs, ctx = runner.block_size, args.b1_ctx
    table = blocks.take(-(-ctx // bs))
    entries = [(ctx - 1, 1, table)]
    out = {"ctx": ctx, "layers": cfg.num_layers}
    dev, dt = m.device, m.dtype
    with torch.inference_mode():
        out["step_ms"] = timer(lambda: runner._decode([5], [ctx - 1], entries)) * 1e3
        step = runner.graphs.get(1)
        if step is not None:
            out["graph_replay_ms"] = timer(step.graph.replay) * 1e3
        g = torch.Generator(device=dev).manual_seed(4)
        L = cfg.num_layers
        ops = m.fused if m.fused is not None else None
        gemv = {}

        def per_layer(fn):  # layer i % L on the i-th call: each call a weight not in L2
            it = iter(range(1 << 30))
            return timer(lambda: fn(next(it) % L))

        for name in ("qkv", "o", "gate_up", "down"):
            w0 = getattr(m.layers[0], name)
            n_in = w0.shape[1]
            x = torch.randn(1, n_in, generator=g, device=dev, dtype=dt)
            if name == "down" and ops is not None:
                gu = torch.randn(1, 2 * n_in, generator=g, device=dev, dtype=dt)
                sec = per_layer(lambda i, gu=gu: m._silu_down(gu, m.layers[i].down, ops))
                name = "silu_mul+down"
            else:
                sec = per_layer(lambda i, n=name, x=x: m._linear(x, getattr(m.layers[i], n)))
            nbytes = (w0.q.numel() if isinstance(w0, fp8.Fp8Weight)
                      else w0.numel() * w0.element_size())
            gemv[name] = {"us": sec * 1e6, "gb_s": nbytes / sec / 1e9,
                          "fraction": nbytes / sec / args.bandwidth, "bytes": nbytes}
        x = torch.randn(1, cfg.hidden_size, generator=g, device=dev, dtype=dt)
        sec = timer(lambda: m._linear(x, m.lm_head))
        w = m.lm_head
        nbytes = w.q.numel() if isinstance(w, fp8.Fp8Weight) else w.numel() * w.element_size()
        gemv["lm_head"] = {"us": sec * 1e6, "gb_s": nbytes / sec / 1e9,
                           "fraction": nbytes / sec / args.bandwidth, "bytes": nbytes}
        out["gemv"] = gemv
        out["gemv_ms"] = (sum(v["us"] for k, v in gemv.items() if k != "lm_head") * L
                          + gemv["lm_head"]["us"]) / 1e3
        small = {}
        if ops is not None:
            r = torch.randn(1, cfg.hidden_size, generator=g, device=dev, dtype=dt)
            small["add_rms_norm"] = timer(
                lambda: ops.add_rms_norm(x, r, m.layers[0].ln1, cfg.rms_norm_eps)) * 2 * L
            qkv = torch.randn(1, m.q_size + 2 * m.kv_size, generator=g, device=dev, dtype=dt)
            pos = torch.full((1,), ctx - 1, dtype=torch.long, device=dev)
            slots = torch.full((1,), table[-1] * bs, dtype=torch.long, device=dev)
            small["rope_kv"] = timer(lambda: ops.rope_kv(
                qkv, m.cos, m.sin, pos, slots, *runner.attn.flat_kv(0), cfg.num_heads,
                cfg.num_kv_heads, cfg.head_dim, runner.attn.kv_scales(0))) * L
        from kiln.llm.cuda_runner import DecodeMeta

        q = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=g, device=dev, dtype=dt)
        meta = DecodeMeta(None, torch.tensor([table], dtype=torch.int32, device=dev),
                          torch.full((1,), ctx, dtype=torch.int32, device=dev))
        small["attention"] = timer(lambda: runner.attn.attend(0, q, meta)) * L
        out["small_ms"] = {k: v * 1e3 for k, v in small.items()}
        total = out.get("graph_replay_ms", out["step_ms"])
        out["rest_ms"] = total - out["gemv_ms"] - sum(out["small_ms"].values())
        out["bound_ms"] = (cfg.weight_bytes(1 if m.weights == "fp8" else dt.itemsize)
                           / args.bandwidth * 1e3)
        out["fraction_of_bound"] = out["bound_ms"] / total
        out["kernels_per_step"] = kernels_per_step(runner, entries)
    return out


def kernels_per_step(runner, entries) -> dict | str:
    """Kernels one eager decode step launches, in all and by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    if runner.model.device.type != "cuda":
        return "cuda only"
    step = runner._make_step(len(entries), max(len(t) for _, _, t in entries))
    runner._fill(step, [5] * len(entries), [e[0] for e in entries], entries)
    runner._body(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._body(step)
        torch.cuda.synchronize()
    names = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    return {"total": sum(names.values()),
            "by_name": dict(sorted(names.items(), key=lambda kv: -kv[1])[:16])}


def engine_decode(engine, cfg, args) -> dict:
    """Wall time of the engine's decode-only steps and the runner's share of it."""
    from kiln.llm import SamplingParams

    rng = random.Random(2)
    n = args.engine_seqs
    p = SamplingParams(max_tokens=args.engine_steps + 4, temperature=0, ignore_eos=True)
    reqs = [engine.add_request([rng.randrange(3, cfg.vocab_size)
                                for _ in range(args.engine_prompt)], p) for _ in range(n)]
    while not all(r.output_token_ids for r in reqs):  # the prefill phase (not timed)
        engine.step()
    engine.step()  # a first decode-only step: graph capture at this batch size
    runner, execute = engine.runner, engine.runner.execute
    inside = []

    def timed(o):
        t0 = time.perf_counter()
        try:
            return execute(o)
        finally:
            inside.append(time.perf_counter() - t0)

    runner.execute = timed
    walls = []
    try:
        for _ in range(args.engine_steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
    finally:
        del runner.execute
    while engine.has_unfinished():
        engine.step()
    wall, run = statistics.median(walls), statistics.median(inside)
    return {"seqs": n, "prompt": args.engine_prompt, "steps": len(walls),
            "step_ms": wall * 1e3, "runner_ms": run * 1e3, "host_ms": (wall - run) * 1e3,
            "tok_s": n / wall}


def run(args) -> dict:
    t = time.perf_counter()
    engine, cfg, witem = make_engine(args)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start_s = time.perf_counter() - t  # weights made, the runner's tuning, the warm-up
    runner = engine.runner
    timer = Timer(args.device, args.iters)
    res = {"model": cfg.name, "weights": args.weights, "kv_cache_dtype": args.kv_cache_dtype,
           "kv_blocks": runner.num_blocks, "build_s": start_s}
    if args.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    blocks = Blocks(runner.num_blocks)
    parts = [p for p in args.parts.split(",") if p]
    emit = Emit(args.json, res)
    for part, fn in (("prefill", lambda: prefill_step(engine, cfg, blocks, args, timer)),
                     ("decode", lambda: decode_step(engine, cfg, blocks, args, timer)),
                     ("decode_b1", lambda: decode_b1(engine, cfg, blocks, args, timer)),
                     ("engine_decode", lambda: engine_decode(engine, cfg, args))):
        if part not in parts:
            continue
        try:
            res[part] = fn()
        except Exception as e:  # one part's failure is a row, the others still run
            import traceback

            traceback.print_exc()
            res[part] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        emit()
    res["paths"] = runner.describe()
    kv_item = runner.cache.element_size()
    res["bound"] = bound(cfg, witem, kv_item, args.prompts, args.prompt_len, args.batch,
                         args.ctx, bandwidth=args.bandwidth, flops=args.flops)
    if isinstance(res.get("decode"), dict) and "step_ms" in res["decode"]:
        d = res["decode"]
        d["fraction_of_bound"] = res["bound"]["decode_step_ms"] / d.get("graph_replay_ms",
                                                                         d["step_ms"])
    if isinstance(res.get("prefill", {}).get("step_ms_default"), float):
        res["prefill"]["fraction_of_bound"] = (res["bound"]["prefill_step_ms"]
                                               / res["prefill"]["step_ms_default"])
    emit()
    return res


class Emit:
    """Print the result so far and rewrite ``--json`` (a run cut off still leaves its parts)."""

    def __init__(self, path, res):
        self.path, self.res = path, res

    def __call__(self):
        print(json.dumps(self.res, default=str), flush=True)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.res, f, indent=1, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="7b", choices=["7b", "tiny"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--weights", default="dtype", choices=["dtype", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"])
    ap.add_argument("--parts", default="prefill,decode,decode_b1,engine_decode")
    ap.add_argument("--prompts", type=int, default=16, help="prompts in the prefill step")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="sequences in the decode step")
    ap.add_argument("--ctx", type=int, default=640, help="cached tokens of each")
    ap.add_argument("--b1-ctx", type=int, default=64, help="cached tokens of the b1 step")
    ap.add_argument("--engine-seqs", type=int, default=256)
    ap.add_argument("--engine-prompt", type=int, default=128)
    ap.add_argument("--engine-steps", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=0, help="KV blocks (0: from memory)")
    ap.add_argument("--memory-fraction", type=float, default=0.9)
    ap.add_argument("--bandwidth", type=float, default=BANDWIDTH, help="bytes/s")
    ap.add_argument("--flops", type=float, default=FLOPS, help="matrix FLOP/s")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()
