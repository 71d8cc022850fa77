"""Argument groups shared by the LLM subcommands (generate, serve-llm, bench-llm)."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("model", help="a .gguf file, a Hugging Face directory, a decoder .onnx with "
                   "past_key_values, or `smollm2`")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    g.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto")
    g.add_argument("--weights", default="dtype", choices=["dtype", "int8", "int4", "fp8"],
                   help="GEMM weights: in --dtype, weight-only int8 / int4 in groups of 32 "
                   "(CPU, float32; the LM head int8), or fp8 e4m3 with per-channel scales "
                   "(CUDA)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache: in --dtype (auto), or fp8 e4m3 with per-layer K/V scales "
                   "(twice the blocks of FP16 in the same memory; CUDA's decode kernel reads "
                   "it directly, the CPU dequantizes in torch ops)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV cache: scales from the first step's K/V amax instead of 1.0")
    g.add_argument("--num-blocks", type=int, default=0,
                   help="KV-cache blocks (default: sized from --memory-fraction)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of device memory for the model and its KV cache")
    g.add_argument("--max-num-seqs", type=int, default=0,
                   help="sequences per step (default 0: 64 on CPU, 256 on CUDA)")
    g.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="tokens per step (default 0: 2048 on CPU, 8192 on CUDA)")
    g.add_argument("--max-model-len", type=int, default=0, help="longest prompt + output")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-cuda-graphs", action="store_true")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    g.add_argument("--verbose", action="store_true", help="tracebacks on errors")


def engine_config(args):
    import torch

    from kiln.llm.engine import EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    return EngineConfig(device=args.device, dtype=args.dtype, num_blocks=args.num_blocks,
                        block_size=args.block_size, memory_fraction=args.memory_fraction,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching,
                        cuda_graphs=not args.no_cuda_graphs, weights=args.weights,
                        kv_cache_dtype=args.kv_cache_dtype,
                        calculate_kv_scales=args.calculate_kv_scales)
