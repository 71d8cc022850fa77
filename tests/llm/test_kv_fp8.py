"""The FP8 (e4m3) KV cache on the CPU path: quantize/dequantize, the option's errors, the pool
sizing, and greedy generation against the float32 cache (the Triton kernels' tests are in
test_triton_attention.py, test_triton_fused.py and test_cuda_mixed.py)."""

import pytest
import torch

from kiln.errors import KilnError
from kiln.llm import LLM, SamplingParams, kv_quant
from kiln.llm.config import ModelConfig
from kiln.llm.engine import EngineConfig, _make_runner

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3", "a b c d e f g h i j"]


def test_quantize_round_trip_and_saturation():
    x = torch.tensor([0.0, 0.1, -3.3, 30.6, 447.0, 1000.0, -1e6])
    q = kv_quant.quantize(x, torch.tensor(1.0))
    assert q.dtype == torch.float8_e4m3fn
    back = kv_quant.dequantize(q, torch.tensor(1.0), torch.float32)
    assert back[5] == 448 and back[6] == -448  # saturated, not NaN
    torch.testing.assert_close(back[:5], x[:5], rtol=1 / 16, atol=0)
    s = torch.tensor(0.01)  # 0.1 and 3.3 in range; 30.6 saturates at 4.48
    back = kv_quant.dequantize(kv_quant.quantize(x[:4], s), s, torch.float32)
    torch.testing.assert_close(back[:3], x[:3], rtol=1 / 16, atol=0)
    assert back[3].item() == pytest.approx(4.48)


def test_store_and_load_through_uint8_views():
    flat = torch.zeros(8, 2, 4, dtype=kv_quant.FP8)
    x = torch.randn(3, 2, 4)
    s = torch.tensor(0.5)
    kv_quant.store(flat, torch.tensor([6, 1, 3]), x, s)
    got = kv_quant.load(flat, torch.tensor([[6, 1], [3, 0]]), s, torch.float32)
    assert got.shape == (2, 2, 2, 4) and not got[1, 1].any()
    torch.testing.assert_close(got[0, 0], x[0], rtol=1 / 16, atol=2 ** -9 * 0.5)
    torch.testing.assert_close(got[1, 0], x[2], rtol=1 / 16, atol=2 ** -9 * 0.5)


@pytest.mark.parametrize("name", ["fp16", "fp8_e5m2", "int8"])
def test_unknown_kv_cache_dtype_names_the_choices(name):
    with pytest.raises(KilnError, match="kv_cache_dtype.*auto, fp8, fp8_e4m3"):
        kv_quant.resolve(name, torch.float16)
    assert kv_quant.resolve("auto", torch.float16) == torch.float16
    assert kv_quant.resolve("fp8_e4m3", torch.float16) == kv_quant.FP8


def _model(dtype):
    from kiln.llm.model import LlamaModel
    from tests.llm.helpers import TINY, tiny_state_dict

    cfg = ModelConfig.from_hf(TINY)
    return LlamaModel(cfg, tiny_state_dict(TINY), "cpu", dtype)


def test_pool_of_fp8_blocks_is_twice_fp16(monkeypatch):
    """Bytes per block count the 1-byte dtype: from the same memory, twice the blocks of an
    FP16 cache (four times FP32's)."""
    import os

    from kiln.llm.runner import blocks_from_memory, kv_bytes_per_block

    m = _model(torch.float16)
    fp16 = kv_bytes_per_block(m, 16)
    assert fp16 == 2 * 2 * 16 * 2 * 16 * 2  # K+V, layers, block, kv heads, head dim, bytes
    assert kv_bytes_per_block(m, 16, kv_quant.FP8) * 2 == fp16
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1 << 20, "SC_AVPHYS_PAGES": 3000}
    monkeypatch.setattr(os, "sysconf", lambda k: pages[k])  # 12 MB free: 6 MB for the cache
    n16 = blocks_from_memory(m, 16, 0.9)
    n8 = blocks_from_memory(m, 16, 0.9, kv_quant.FP8)
    assert n16 == 3000 * 4096 // 2 // fp16 and n8 in (2 * n16, 2 * n16 + 1)
    runner = _make_runner(m, EngineConfig(kv_cache_dtype="fp8", block_size=16))
    assert runner.num_blocks == n8 and runner.cache.dtype == kv_quant.FP8
    assert runner.cache.nbytes == n8 * fp16 // 2


def test_fp8_cache_turns_native_decode_off():
    m = _model(torch.float32)
    assert _make_runner(m, EngineConfig(num_blocks=8)).native_decode == m.native_decode_ok()
    runner = _make_runner(m, EngineConfig(num_blocks=8, kv_cache_dtype="fp8"))
    assert not runner.native_decode  # the native stack reads float32 K/V


def test_onnx_decoder_refuses_fp8_kv():
    from kiln.llm.onnx_decoder import OnnxDecoder

    m = OnnxDecoder.__new__(OnnxDecoder)
    m.dtype = torch.float32
    with pytest.raises(KilnError, match="kv_cache_dtype='fp8'.*ONNX decoder.*--kv-cache-dtype"):
        _make_runner(m, EngineConfig(num_blocks=8, kv_cache_dtype="fp8"))


def _tokens(llm, p):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_greedy_tracks_full_precision_kv(tiny_dir, dtype):
    """Greedy tokens over an e4m3 cache against a cache in the model's dtype (tiny random
    Llama, CPU torch path, FP32 or FP16 model). With scales from the prompts' amax, the first 8
    tokens of every prompt are the full-precision cache's (measured: 38 of 40 tokens). With
    the default scale 1.0 the tolerance is looser: 3 of 4 first tokens, and 20 of 40 tokens
    before each prompt's first difference (measured: 23; one prompt differs from its first
    token on a near tie of this random model's logits, one after 3 tokens). This path reads
    the prompt's own K/V back from the cache; CUDA prefill attends to the fresh ones."""
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = _tokens(LLM(tiny_dir, device="cpu", num_blocks=64, dtype=dtype), p)
    calc = LLM(tiny_dir, device="cpu", num_blocks=64, dtype=dtype, kv_cache_dtype="fp8",
               calculate_kv_scales=True)
    got = _tokens(calc, p)
    assert [g[:8] for g in got] == [w[:8] for w in want]
    d = calc.engine.runner.describe_kv()
    assert d["kv_cache_dtype"] == "float8_e4m3fn" and d["calculated"]
    assert 0 < d["k_scale"][0] < 1 and 0 < d["v_scale"][0] < 1
    unit = LLM(tiny_dir, device="cpu", num_blocks=64, dtype=dtype, kv_cache_dtype="fp8")
    got = _tokens(unit, p)
    assert unit.engine.runner.describe_kv()["k_scale"] == [1.0, 1.0]
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 3
    prefix = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
                 for g, w in zip(got, want))
    assert prefix >= 20, (got, want)


def test_fp8_kv_with_prefix_cache_and_chunks(tiny_dir):
    """Chunked prefill (8 tokens a step) and a prefix-cache hit read e4m3 blocks written by
    earlier steps: a request's tokens do not depend on what it ran beside."""
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    long = "The quick brown fox jumps over the lazy dog. " * 3
    kw = dict(num_blocks=64, kv_cache_dtype="fp8", calculate_kv_scales=True)
    llm = LLM(tiny_dir, device="cpu", max_num_batched_tokens=8, **kw)
    first = llm.generate([long], p)[0].outputs[0].token_ids  # calibrates on this prompt
    again = llm.generate([long + "again", long], p)
    assert again[1].outputs[0].token_ids == first
    assert again[1].num_cached_tokens > 0


def test_cli_kv_cache_dtype_reaches_the_engine():
    import argparse

    from kiln.cli.llm_args import add_engine_args, engine_config

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    cfg = engine_config(ap.parse_args(["m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"]))
    assert cfg.kv_cache_dtype == "fp8" and cfg.calculate_kv_scales
    assert engine_config(ap.parse_args(["m"])).kv_cache_dtype == "auto"
