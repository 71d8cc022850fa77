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
    orig = CudaAttention._mixed_attend  # both paths: after write (torch RoPE) or the fused one

    def spy(self, layer, q, k, v, meta):
        if layer == 0:
            seen.append((meta.dec_rows is not None,
                         [start for _, _, start, blocks in meta.prefills if blocks is not None]))
        return orig(self, layer, q, k, v, meta)

    monkeypatch.setattr(CudaAttention, "_mixed_attend", spy)
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


@pytest.mark.parametrize("batch_prefill", [True, False])
def test_equal_length_prompts_run_as_one_batched_attention(batch_prefill):
    """Whole prompts of one length next to each other form a run (one batched causal SDPA);
    a decode row, another length or a cached prefix ends it. Batched or one call a prompt, the
    output is the torch path's."""
    from kiln.llm.attention import TorchPagedAttention, build_meta
    from kiln.llm.cuda_runner import MixedMeta

    g = torch.Generator().manual_seed(3)
    heads, kv, d, bs = 4, 2, 16, 4
    entries = [(0, 5, [1, 2]), (0, 5, [3, 4]), (0, 3, [5]), (6, 1, [6, 7]), (0, 3, [8]),
               (0, 3, [9]), (0, 3, [10]), (19, 4, [0, 11, 12, 13, 14, 15]), (0, 5, [16, 17])]
    t = sum(n for _, n, _ in entries)
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(t, kv, d, generator=g)
    v = torch.randn(t, kv, d, generator=g)
    cache = torch.randn(1, 2, 18, bs, kv, d, generator=g)
    ref_cache = cache.clone()
    want = TorchPagedAttention(ref_cache, heads)(0, q, k, v, build_meta(entries, bs, "cpu"))
    meta = MixedMeta(entries, bs, DEV)
    assert meta.runs == [(0, 5, 2), (10, 3, 1), (14, 3, 3), (27, 5, 1)]
    attn = CudaAttention(cache.to(DEV), heads)
    attn.batch_prefill = batch_prefill
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(qs, *a, **kw):
        calls.append(qs.shape[0])
        return real(qs, *a, **kw)

    import kiln.llm.cuda_runner as cr

    orig = cr.F.scaled_dot_product_attention
    cr.F.scaled_dot_product_attention = sdpa
    try:
        got = attn(0, q.to(DEV), k.to(DEV), v.to(DEV), meta).cpu()
    finally:
        cr.F.scaled_dot_product_attention = orig
    torch.testing.assert_close(got, want, **TOL)
    # runs of 2, 1, 3, 1 prompts + the continued chunk; else one call per chunk
    assert sorted(calls) == ([1, 1, 1, 2, 3] if batch_prefill else [1] * 8)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_fused_prefill_matches_torch_path_and_batches(tiny_dir, monkeypatch, kv_dtype):
    """Four prompts of one length (token ids) in one step with the fused kernels: RoPE + the
    cache write as one kernel that hands back the rotated K, one batched SDPA for the four;
    each request's tokens are its tokens alone on the torch path (FP16 cache and FP8)."""
    from kiln.llm import fused

    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 40, 300 + 7 * i, 9, 1000 + i, 23] for i in range(4)]
    want = [o.outputs[0].token_ids for o in LLM(
        tiny_dir, num_blocks=64, kv_cache_dtype=kv_dtype).generate(prompts, p)]
    llm = LLM(tiny_dir, num_blocks=64, kv_cache_dtype=kv_dtype)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 64, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, fused_ops=True, kv_cache_dtype=kv_dtype)
    runs, k_flags = [], []
    orig_attend = CudaAttention._mixed_attend
    orig_rope = fused.FusedOps.rope_kv

    def spy(self, layer, q, k, v, meta):
        if layer == 0:
            runs.append(list(meta.runs))
        return orig_attend(self, layer, q, k, v, meta)

    def rope_spy(self, *a, with_k=False):
        k_flags.append(with_k)
        return orig_rope(self, *a, with_k=with_k)

    monkeypatch.setattr(CudaAttention, "_mixed_attend", spy)
    monkeypatch.setattr(fused.FusedOps, "rope_kv", rope_spy)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert got == want
    assert [(0, 6, 4)] in runs
    assert True in k_flags and False in k_flags  # K asked for in the prefill step only
    assert eng.runner.model.fused.paths["rope_kv"] == "triton"


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_warmup_runs_a_mixed_step_on_the_scratch_block_only(tiny_dir, monkeypatch, kv_dtype):
    """warmup(): four mixed steps (two whole prompts as one run, 2 or 20 decode rows, tables
    16 or 17 blocks wide) that write nothing outside the scratch block; skipped while FP8
    scales wait for calibration."""
    llm = LLM(tiny_dir, num_blocks=16)
    eng = llm.engine
    r = CudaModelRunner(eng.model, 16, eng.config.block_size, cuda_graphs=False,
                        max_model_len=64, fused_ops=True, kv_cache_dtype=kv_dtype)
    seen = []
    orig = CudaAttention._mixed_attend

    def spy(self, layer, q, k, v, meta):
        dec = meta.dec_rows is not None
        seen.append((list(meta.runs), len(meta.dec_rows) if dec else 0,
                     meta.dec_tables.shape[1] if dec else 0))
        return orig(self, layer, q, k, v, meta)

    monkeypatch.setattr(CudaAttention, "_mixed_attend", spy)
    before = r.cache.clone()
    r.warmup(max_tokens=200)  # + one step of 3 prompts of 64 tokens (max_model_len 64)
    bs = eng.config.block_size
    assert seen[:8:2] == [([(0, bs, 2)], n, w) for w in (16, 17) for n in (2, 20)]  # 2 layers
    assert seen[8:] == [([(0, 64, 3)], 0, 0)] * 2
    pool = (slice(None), slice(None), slice(0, r.scratch))
    assert torch.equal(r.cache[pool].view(torch.uint8), before[pool].view(torch.uint8))
    assert not torch.equal(r.cache.view(torch.uint8), before.view(torch.uint8))  # scratch
    seen.clear()
    cal = CudaModelRunner(eng.model, 16, eng.config.block_size, cuda_graphs=False,
                          max_model_len=64, kv_cache_dtype="fp8", calculate_kv_scales=True)
    cal.warmup()
    assert not seen and cal.kv_scales.calibrating
