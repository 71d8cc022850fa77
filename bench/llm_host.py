"""The LLM engine's host work per step, without the model: bench.llm's 256-request run (512 in /
256 out, the CUDA engine's limits: 256 sequences, 8192 tokens a step) through the CUDA runner's
host code on the CPU, with a model that computes nothing (its logits name the next token).

    python -m bench.llm_host                      # the 7B shape's vocabulary, 256 x (512 / 256)
    python -m bench.llm_host --requests 64 --json host.json

What it times is everything of an engine step but the kernels: the scheduler, the KV blocks and
prefix hashes, the runner's inputs (ids, positions, block tables; the decode buffer fill; the
mixed steps' MixedMeta), sampling's bookkeeping, the detokenizer, metrics. The rows are the
prefill phase (until every prompt has its first token) and the decode phase, each split into the
parts of ``kiln.llm.profile`` (medians of ``--rounds`` runs). On a GPU the same parts are in
bench.llm's throughput row; this runs anywhere, so host-side changes are measured here.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from bench.llm import placeholder_tokenizer, throughput_256
from kiln.llm.config import ModelConfig
from kiln.llm.engine import EngineConfig, LLMEngine

# the 7B shape's vocabulary and context; the layers are tiny (the model never runs them)
SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
             hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
             max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2)
WIDTH = 64  # logits columns of the null model: token ids 3 .. 62


def null_forward(ids, positions, attn, meta, rows):
    """Logits [rows, WIDTH] whose argmax is a token made from each row's input id."""
    src = ids if rows is None else ids[rows]
    out = torch.zeros(src.shape[0], WIDTH)
    out[torch.arange(src.shape[0]), src % (WIDTH - 4) + 3] = 1.0
    return out


def null_engine(num_blocks: int) -> LLMEngine:
    """An engine over the CUDA runner (on the CPU: no graphs, no tuning) whose model is
    ``null_forward``."""
    import kiln.llm.engine as engine_mod
    from kiln.llm.cuda_runner import CudaModelRunner
    from kiln.llm.model import LlamaModel

    cfg = ModelConfig.from_hf(SHAPE)
    sd = {"model.embed_tokens.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size),
          "model.norm.weight": torch.ones(cfg.hidden_size)}
    h, i = cfg.hidden_size, cfg.intermediate_size
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        sd.update({p + "input_layernorm.weight": torch.ones(h),
                   p + "post_attention_layernorm.weight": torch.ones(h),
                   **{p + f"self_attn.{x}_proj.weight": torch.zeros(h, h) for x in "qkvo"},
                   p + "mlp.gate_proj.weight": torch.zeros(i, h),
                   p + "mlp.up_proj.weight": torch.zeros(i, h),
                   p + "mlp.down_proj.weight": torch.zeros(h, i)})
    model = LlamaModel(cfg, sd, "cpu", torch.float32)
    model.forward = null_forward
    make = engine_mod._make_runner

    def runner(m, c, max_num_seqs=None):
        return CudaModelRunner(m, num_blocks, c.block_size, cuda_graphs=False, max_batch=256,
                               max_model_len=2048)
    engine_mod._make_runner = runner
    try:
        return LLMEngine.from_model(model, placeholder_tokenizer(cfg.vocab_size), "null",
                                    EngineConfig(device="cpu", max_num_seqs=256,
                                                 max_num_batched_tokens=8192,
                                                 max_model_len=2048, warmup=False))
    finally:
        engine_mod._make_runner = make


def run(args) -> dict:
    blocks = args.requests * -(-(args.prompt + args.out) // 16) + 16
    rounds = []
    for r in range(args.rounds):
        eng = null_engine(blocks)
        rounds.append(throughput_256(eng, random.Random(r), args.requests, args.prompt,
                                     args.out))
    out = {"requests": args.requests, "prompt": args.prompt, "out": args.out,
           "rounds": args.rounds, "torch_threads": torch.get_num_threads()}
    for phase in ("prefill", "decode"):
        ss = [x[f"{phase}_phase"] for x in rounds]
        parts = ss[0]["median_ms"].keys()
        out[phase] = {"steps": ss[0]["steps"],
                      "step_ms": statistics.median(s["wall_ms_median"] for s in ss),
                      "parts_ms": {p: round(statistics.median(s["median_ms"][p] for s in ss), 4)
                                   for p in parts},
                      "phase_s": statistics.median(s["wall_s"] for s in ss)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = run(args)
    for phase in ("prefill", "decode"):
        r = res[phase]
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["parts_ms"].items())
        print(f"{phase}: {r['steps']} steps, median step {r['step_ms']:.2f} ms ({parts} ms), "
              f"phase {r['phase_s']:.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
