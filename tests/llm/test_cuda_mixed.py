"""The CUDA runner's steps with prefill chunks (MixedMeta): decode rows through the Triton
kernel, chunks through SDPA (interpreter on the CPU)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kiln.llm import LLM, SamplingParams
from kiln.llm.cuda_runner import CudaAttention, CudaModelRunner

LONG = "The quick brown fox jumps over the lazy dog. " * 3
# the Triton side of the attention tests: the GPU where there is one (float32 tl.dot runs in
# TF32 there: 1e-3-level differences), else the interpreter on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=2e-3, atol=2e-3) if DEV == "cuda" else dict(rtol=1e-4, atol=1e-4)


def _alone(tiny_dir, prompt, p):
    return LLM(tiny_dir, num_blocks=64).generate([prompt], p)[0].outputs[0].token_ids


@pytest.mark.parametrize("fused_ops", [False, True])
def test_mixed_steps_match_each_request_alone(tiny_dir, monkeypatch, fused_ops):
    """A decoding request beside a chunked prefill (8 tokens a step: chunks past the first
    attend over their cached blocks) and a prompt seen before (a prefix-cache hit): each
    request's tokens are those it gets alone on the torch path."""
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(tiny_dir, num_blocks=64, max_num_batched_tokens=8)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 64, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, fused_ops=fused_ops)
    seen = []
    orig = CudaAttention._mixed

    def spy(self, layer, q, k, v, meta):
        if layer == 0:
            seen.append((meta.dec_rows is not None,
                         [start for _, _, start, blocks in meta.prefills if blocks is not None]))
        return orig(self, layer, q, k, v, meta)

    monkeypatch.setattr(CudaAttention, "_mixed", spy)
    prompts = ["Hello there", LONG, LONG + "again"]
    got = {}
    reqs = [eng.add_request(prompts[0], p)]
    for i in range(40):
        if i == 2:
            reqs.append(eng.add_request(prompts[1], p))
        if i == 12:
            reqs.append(eng.add_request(prompts[2], p))  # LONG's blocks are cached by now
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if i > 12 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    for r, prompt in zip(reqs, prompts):
        assert got[r.request_id] == _alone(tiny_dir, prompt, p), prompt
    assert any(dec and starts for dec, starts in seen)  # decodes beside a continued chunk
    assert reqs[2].num_cached_tokens > 0
    assert eng.runner.describe()["decode"] == "eager-triton"


def _step(g, heads: int, kv: int, d: int):
    """One mixed step's entries (two decodes, a fresh 5-token prompt, a 4-token chunk after 19
    cached tokens, over scattered blocks) and its new q, k, v."""
    entries = [(6, 1, [3, 9]), (0, 5, [4, 11]), (19, 4, [0, 5, 7, 2, 14, 8]), (2, 1, [13])]
    t = sum(n for _, n, _ in entries)
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kv, d, generator=g)
    v = torch.randn(t, kv, d, generator=g)
    return entries, q, k, v


def test_mixed_attention_matches_torch_attention():
    """One step of two decodes, a fresh 5-token prompt and a 4-token chunk after 19 cached
    tokens, over scattered blocks (GQA 4/2): MixedMeta's attention gives the torch path's
    output and cache."""
    from kiln.llm.attention import TorchPagedAttention, build_meta
    from kiln.llm.cuda_runner import MixedMeta

    g = torch.Generator().manual_seed(0)
    heads, kv, d, bs = 4, 2, 16, 4
    cache = torch.randn(1, 2, 16, bs, kv, d, generator=g)
    entries, q, k, v = _step(g, heads, kv, d)
    ref_cache = cache.clone()
    want = TorchPagedAttention(ref_cache, heads)(0, q, k, v, build_meta(entries, bs, "cpu"))
    meta = MixedMeta(entries, bs, DEV)
    assert meta.dec_rows.tolist() == [0, 10] and [p[:3] for p in meta.prefills] == [
        (1, 5, 0), (6, 4, 19)]
    cache = cache.to(DEV)
    got = CudaAttention(cache, heads)(0, q.to(DEV), k.to(DEV), v.to(DEV), meta).cpu()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(cache.cpu(), ref_cache, rtol=0, atol=0)


def test_mixed_attention_fp8_cache_matches_torch_attention():
    """The same step over an e4m3 cache with calibrated-style scales: the same cache bytes as
    the torch path's write; decode rows and the continued chunk (both read the dequantized
    cache) its output to float rounding; the fresh prompt, which attends to its unquantized
    K/V, within e4m3's error of it."""
    from kiln.llm import kv_quant
    from kiln.llm.attention import TorchPagedAttention, build_meta
    from kiln.llm.cuda_runner import MixedMeta

    g = torch.Generator().manual_seed(0)
    heads, kv, d, bs = 4, 2, 16, 4
    scales = kv_quant.KVScales(1, "cpu")
    scales.t[0] = torch.tensor([0.02, 0.01])
    cache = kv_quant.quantize(torch.randn(1, 2, 16, bs, kv, d, generator=g), scales.t[0, 0])
    entries, q, k, v = _step(g, heads, kv, d)
    ref_cache = cache.clone()
    want = TorchPagedAttention(ref_cache, heads, scales)(0, q, k, v,
                                                         build_meta(entries, bs, "cpu"))
    dev_scales = kv_quant.KVScales(1, DEV)
    dev_scales.t[0] = scales.t[0].to(DEV)
    cache = cache.to(DEV)
    got = CudaAttention(cache, heads, dev_scales)(0, q.to(DEV), k.to(DEV), v.to(DEV),
                                                  MixedMeta(entries, bs, DEV)).cpu()
    assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
    cached_rows = [0, 6, 7, 8, 9, 10]  # the decodes and the chunk after 19 cached tokens
    torch.testing.assert_close(got[cached_rows], want[cached_rows], **TOL)
    fresh = slice(1, 6)
    err = (got[fresh] - want[fresh]).abs().max().item()
    assert 0 < err < 0.1, err  # fresh K/V against their e4m3 copies
