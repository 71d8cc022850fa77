"""The paged decode attention kernel alone: FP16 against FP8 KV, the tl.dot kernel against the
tiled MHA variant, at the Llama-2-7B shape of the 256-request throughput row.

    python -m bench.llm_attention                     # H200: batch 256, 640 cached tokens
    python -m bench.llm_attention --ctx 1024 --tiles 0,64 --warps 4,8 --json attn.json

One layer's decode attention (``kiln.llm.triton_attention.paged_decode``) over a cache whose
blocks are scattered at random, as the pool hands them out. Per KV dtype (``--kv``: auto = FP16,
fp8) and kernel (``--tiles``: 0 = the tl.dot kernel, N = ``KILN_LLM_DECODE_TILE=N:W`` for each W
of ``--warps``): the median time of ``--iters`` calls (CUDA events), the K/V bytes read per
second and their fraction of 4.3 TB/s, the attention-only ceiling of a decode step (batch /
(layers x time): tokens/s if the step were nothing else), and the largest difference from the
FP16 tl.dot kernel's output. One
layer's cache at 256 x 640 tokens is 1.3 GB (FP16) per K or V: far past the L2, so the timing
streams from HBM as decode does. On the CPU (``TRITON_INTERPRET=1``) it runs for tests only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.llm import BANDWIDTH
from kiln.llm import kv_quant
from kiln.llm.triton_attention import KQ, PF, decode_splits, paged_decode


def make_case(batch, ctx, heads, kv_heads, head_dim, block_size, device, seed=0):
    """(q, K cache, V cache, tables, lens) in FP16 (float32 on the CPU)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.float16 if device == "cuda" else torch.float32
    per_seq = -(-ctx // block_size)
    blocks = batch * per_seq + 1
    tables = torch.randperm(blocks - 1, generator=g)[:batch * per_seq].view(batch, per_seq)
    kc = torch.randn(blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.randn(blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, kc, vc, tables.to(device=device, dtype=torch.int32), lens


def median_call_s(fn, iters: int, device: str, warmup: int = 3) -> float:
    """Median seconds of one call of ``fn`` over ``iters`` calls after ``warmup``: CUDA events
    around each call on the GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(batch=256, ctx=640, heads=32, kv_heads=32, head_dim=128, block_size=16, layers=32,
        kvs=("auto", "fp8"), tiles=(0, 32, 64, 128), iters=20, device="cuda",
        warps=(4,), dot_tiles=(), kq_tiles=(), stages=(), pf_tiles=()) -> list[dict]:
    """One row per KV dtype and kernel: ``tiles`` 0 = the tl.dot kernel, N = the tiled MHA
    kernel with N tokens a tile, once per ``warps``; ``dot_tiles``: the tl.dot kernel with N
    tokens a tile (``KILN_LLM_DECODE_DOT_TILE=N:W``), once per ``warps``; ``kq_tiles``: its
    K . q^T variant (``_decode_split_kq``), once per ``warps``; ``stages``: the dot and kq
    kernels again at each of these num_stages; ``pf_tiles``: the tiled MHA kernel with the next
    tile prefetched (PREFETCH), once per ``warps``."""
    q, kc, vc, tables, lens = make_case(batch, ctx, heads, kv_heads, head_dim, block_size, device)
    scale = head_dim ** -0.5
    sms = (torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda"
           else 132)
    splits = decode_splits(batch, kv_heads, sms)
    ref = paged_decode(q, kc, vc, tables, lens, scale, splits).float()
    rows = []
    for kv in kvs:
        if kv == "auto":
            k, v, sc = kc, vc, None
        else:
            kv_quant.resolve(kv, q.dtype)
            sc = torch.stack([kc.abs().amax(), vc.abs().amax()]).float() * (2 / kv_quant.FP8_MAX)
            k, v = kv_quant.quantize(kc, sc[0]), kv_quant.quantize(vc, sc[1])
        kernels = [(t, w, None) for t in tiles for w in (warps if t else (None,))]
        kernels += [((t, PF), w, None) for t in pf_tiles for w in warps]
        kernels += [(0, None, (t, w)) for t in dot_tiles for w in warps]
        kernels += [(0, None, (t, w, KQ)) for t in kq_tiles for w in warps]
        kernels += [(0, None, (t, w, st)) for t in dot_tiles for w in warps for st in stages]
        kernels += [(0, None, (t, w, st, KQ)) for t in kq_tiles for w in warps for st in stages]
        for tile, w, dot in kernels:
            pf = isinstance(tile, tuple)
            tile = tile[0] if pf else tile
            name = "dot" if not tile else f"tile{tile}" + (f":{w}" if len(warps) > 1 else "")
            name += ":pf" if pf else ""
            if dot:
                nums = [c for c in dot if c != KQ]
                name = (("kq" if dot[-1] == KQ else "dot") + f"{nums[0]}:{nums[1]}"
                        + (f":s{nums[2]}" if len(nums) > 2 else ""))
            row = {"kv_cache_dtype": kv, "kernel": name,
                   "batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim, "splits": splits}
            if tile and heads != kv_heads:
                row["skipped"] = "the tiled kernel is for MHA (heads == kv_heads)"
                rows.append(row)
                print(row, flush=True)
                continue

            def call(k=k, v=v, sc=sc, tile=tile, w=w, dot=dot, pf=pf):
                mha = ((tile, w, PF) if pf else (tile, w)) if tile else None
                return paged_decode(q, k, v, tables, lens, scale, splits, kv_scale=sc,
                                    mha_tile=mha, dot_tile=dot)
            try:
                out = call().float()
                sec = median_call_s(call, iters, device)
            except Exception as e:  # a kernel that fails to compile is a row, not the end
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(row, flush=True)
                continue
            nbytes = batch * ctx * 2 * kv_heads * head_dim * k.element_size()
            row.update(us=sec * 1e6, gb_s=nbytes / sec / 1e9,
                       fraction_of_bandwidth=nbytes / sec / BANDWIDTH,
                       attention_only_step_tok_s=batch / (layers * sec),
                       max_diff_vs_fp16_dot=(out - ref).abs().max().item(),
                       ref_max=ref.abs().max().item())
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=640, help="cached tokens per sequence")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32, help="for the step ceiling")
    ap.add_argument("--kv", default="auto,fp8", help="KV cache dtypes (auto = FP16)")
    ap.add_argument("--tiles", default="0,32,64,128",
                    help="kernels: 0 = tl.dot, N = the tiled MHA kernel, N tokens a tile")
    ap.add_argument("--warps", default="4", help="warps of the tiled kernel, e.g. 4,8")
    ap.add_argument("--dot-tiles", default="",
                    help="the tl.dot kernel at N tokens a tile, e.g. 32,64,128 (x --warps)")
    ap.add_argument("--kq-tiles", default="",
                    help="the K . q^T variant of the tl.dot kernel at N tokens a tile (x --warps)")
    ap.add_argument("--stages", default="", help="num_stages to time the dot/kq tiles at too")
    ap.add_argument("--pf-tiles", default="",
                    help="the tiled MHA kernel with the next tile prefetched, N tokens a tile")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = run(args.batch, args.ctx, args.heads, args.kv_heads, args.head_dim, args.block_size,
               args.layers, [k for k in args.kv.split(",") if k],
               [int(t) for t in args.tiles.split(",") if t], args.iters, args.device,
               [int(w) for w in args.warps.split(",") if w],
               [int(t) for t in args.dot_tiles.split(",") if t],
               [int(t) for t in args.kq_tiles.split(",") if t],
               [int(t) for t in args.stages.split(",") if t],
               [int(t) for t in args.pf_tiles.split(",") if t])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
