"""The Triton paged decode kernel against SDPA on gathered keys (interpreter on CPU)."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kiln.llm.triton_attention import paged_decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, kc, vc, tables, lens, scale):
    outs = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        k = kc[tables[i].long()].flatten(0, 1)[:n]  # [n, KV, D]
        v = vc[tables[i].long()].flatten(0, 1)[:n]
        o = F.scaled_dot_product_attention(q[i:i + 1].unsqueeze(2).float(),
                                           k.transpose(0, 1).unsqueeze(0).float(),
                                           v.transpose(0, 1).unsqueeze(0).float(),
                                           scale=scale, enable_gqa=True)
        outs.append(o[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("heads,kv,splits,lens", [
    (4, 2, 3, [1, 17, 40]),  # GQA 2, splits with no tokens for the short sequence
    (3, 3, 1, [33, 5]),  # MHA, one split
    (6, 1, 4, [64, 16]),  # MQA, split boundaries on block boundaries
])
def test_paged_decode_matches_sdpa(heads, kv, splits, lens):
    g = torch.Generator().manual_seed(0)
    d, bs, blocks = 16, 16, 12
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    kc = torch.randn(blocks, bs, kv, d, generator=g).to(DEV, dtype)
    vc = torch.randn(blocks, bs, kv, d, generator=g).to(DEV, dtype)
    perm = torch.randperm(blocks, generator=g)  # scattered, non-increasing block ids
    need = [-(-n // bs) for n in lens]
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(len(lens), heads, d, generator=g).to(DEV, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    got = paged_decode(q, kc, vc, tables.to(DEV), lens_t, d ** -0.5, splits=splits)
    want = reference(q, kc, vc, tables.to(DEV), lens_t, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_cuda_runner_decode_path_matches_torch_path(tiny_dir):
    # the CUDA runner's decode steps (Triton kernel, scratch-block padding) without graphs;
    # on CPU under the interpreter, FP32
    from kiln.llm import LLM, SamplingParams
    from kiln.llm.cuda_runner import CudaModelRunner

    prompts = ["Hello there", "The capital of France is", "1, 2, 3"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_dir, num_blocks=32).generate(prompts, p)]
    llm = LLM(tiny_dir, num_blocks=32)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert got == want


def test_decode_splits_fill_the_gpu_then_stop():
    from kiln.llm.triton_attention import decode_splits

    assert decode_splits(1, 32) == 8  # Llama-2-7B at batch 1: 32 programs alone
    assert decode_splits(16, 32) == 2
    assert decode_splits(256, 32) == 1  # 8192 programs already
    assert decode_splits(64, 8) == 2  # GQA: fewer KV heads, more splits
    assert all(1 <= decode_splits(b, kv) <= 8 for b in (1, 3, 1000) for kv in (1, 8, 64))
