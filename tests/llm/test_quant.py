"""Weight-only INT8/INT4 (kiln/llm/quant.py) and the native decode stack (kiln/native/llm.c)
against torch references."""

import pytest
import torch

from kiln import native
from kiln.errors import KilnError
from kiln.llm import LLM, SamplingParams, quant
from kiln.llm.attention import TorchPagedAttention, build_meta
from kiln.llm.config import ModelConfig
from kiln.llm.model import LlamaModel
from tests.llm.conftest import SMOLLM2, needs_smollm2
from tests.llm.helpers import TINY, tiny_state_dict

needs_native = pytest.mark.skipif(not quant.native_ok(), reason="kiln/native is not built")


def test_quantize_round_trips_gguf_style_values():
    g = torch.Generator().manual_seed(0)
    # Q8_0-like: d * q (d in FP16, as GGUF stores it) with 127 reached in each group -> exact
    d = (torch.rand(8, 4, 1, generator=g) + 0.01).half().float()
    q = torch.randint(-127, 128, (8, 4, 32), generator=g)
    q[..., 0] = 127
    w8 = (d * q).reshape(8, 128)
    assert torch.equal(quant.dequantize_reference(quant.quantize(w8, "int8")), w8)
    # Q4_1-like: d * q + m with q spanning 0..15 -> the same values back (to rounding)
    q4 = torch.randint(0, 16, (8, 4, 32), generator=g)
    q4[..., 0], q4[..., 1] = 0, 15
    m = torch.randn(8, 4, 1, generator=g).half().float()
    w4 = (d * q4 + m).reshape(8, 128)
    back = quant.dequantize_reference(quant.quantize(w4, "int4"))
    torch.testing.assert_close(back, w4, rtol=0, atol=1e-5)
    # random weights: the error is at most half a step of each group (plus the FP16 rounding
    # of the scale and minimum)
    w = torch.randn(16, 64, generator=g)
    for fmt, steps in (("int8", 254), ("int4", 15)):
        qw = quant.quantize(w, fmt)
        assert qw.nbytes() == 16 * quant.row_bytes(fmt, 64)
        rng = w.view(16, 2, 32)
        step = (rng.amax(-1) - rng.amin(-1) if fmt == "int4" else 2 * rng.abs().amax(-1)) / steps
        err = (quant.dequantize_reference(qw) - w).abs().view(16, 2, 32).amax(-1)
        assert bool((err <= step / 2 + rng.abs().amax(-1) * 2**-10).all()), fmt


def test_quantize_refuses_bad_shapes():
    with pytest.raises(KilnError, match="multiple of 32"):
        quant.quantize(torch.randn(4, 40), "int8", "layer 0 qkv")
    with pytest.raises(KilnError, match="int3"):
        quant.quantize(torch.randn(4, 32), "int3")
    with pytest.raises(KilnError, match="FP16"):
        quant.quantize(torch.full((4, 32), 1e6), "int4", "layer 3 down")


def _best_isa() -> int:
    return native._lib.kiln_llm_set_isa(0) if quant.native_ok() else 0


@pytest.fixture(params=[1, 2], ids=["avx2", "avx512"])
def isa(request):
    """Each int GEMV instruction set the CPU has (kiln_llm_set_isa), the best one restored."""
    if request.param > _best_isa():
        pytest.skip("this CPU has no AVX-512 (F, BW, VL)")
    assert native._lib.kiln_llm_set_isa(request.param) == request.param
    yield request.param
    native._lib.kiln_llm_set_isa(0)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40])
def test_quantized_linear_matches_dequantized_gemm(fmt, rows, isa):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 96, generator=g)
    qw = quant.quantize(w, fmt)
    ref_w = quant.dequantize_reference(qw)
    assert torch.equal(qw.dequantize(), ref_w)  # the C dequantizer
    x, b = torch.randn(rows, 96, generator=g), torch.randn(70, generator=g)
    torch.testing.assert_close(quant.linear(x, qw, b), x @ ref_w.T + b, rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, rows, 96, generator=g)  # leading dims kept
    torch.testing.assert_close(quant.linear(x3, qw), x3 @ ref_w.T, rtol=1e-5, atol=1e-4)



@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_gemv_uses_the_dequantized_weights_exactly(fmt, rows, isa):
    """x = rows of the identity: each output is one weight times 1 plus zeros, so it must be
    the dequantized weight bit for bit, on every path (4 weight rows at a time at batch 1, the
    rows past a multiple of 4, several rows of x)."""
    g = torch.Generator().manual_seed(7)
    n, k = 70, 1088  # 34 groups: two scale blocks of 16 and a partial one
    qw = quant.quantize(torch.randn(n, k, generator=g), fmt)
    ref_w = quant.dequantize_reference(qw)
    for start in range(0, k, 97):
        x = torch.zeros(rows, k)
        for r in range(rows):
            x[r, (start + 31 * r) % k] = 1.0
        got = quant.linear(x, qw)
        assert torch.equal(got, x @ ref_w.T), (fmt, start)

def _tiny_model(weights):
    cfg = ModelConfig.from_hf(TINY)
    return LlamaModel(cfg, tiny_state_dict(TINY), "cpu", torch.float32, weights)


@needs_native
@pytest.mark.parametrize("weights", ["dtype", "int8", "int4"])
@pytest.mark.parametrize("seqs", [1, 3])
def test_native_decode_matches_torch_step(weights, seqs, isa):
    """Sequences of different lengths over scattered blocks (one: the batch-1 GEMVs): one
    kiln_llm_decode call gives the torch path's logits and writes the same K/V into the
    cache."""
    model = _tiny_model(weights)
    c, bs = model.cfg, 4
    cache_a = torch.randn(c.num_layers, 2, 32, bs, c.num_kv_heads, c.head_dim)
    cache_b = cache_a.clone()
    starts = [5, 0, 13][:seqs]  # tokens already cached per sequence
    tables = [[7, 3], [20], [1, 30, 9, 4]][:seqs]
    entries = [(s, 1, t) for s, t in zip(starts, tables)]
    ids = torch.tensor([11, 2000, 42][:seqs])
    pos = torch.tensor(starts)
    meta = build_meta(entries, bs, "cpu")
    with torch.inference_mode():
        ref = model.forward(ids, pos, TorchPagedAttention(cache_a, c.num_heads), meta,
                            torch.arange(seqs))
        got = model.decode_native(ids, pos, cache_b, meta)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache_b, cache_a, rtol=1e-5, atol=1e-5)


@needs_native
def test_quantized_engine_runs_prefill_and_decode(tiny_dir):
    """int8/int4 engines (prefill through dequantized GEMMs, decode natively) against the same
    engine with decode in torch ops: the same tokens."""
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3]
    for weights in ("int8", "int4"):
        native = LLM(tiny_dir, num_blocks=64, weights=weights).generate(prompts, p)
        torch_ = LLM(tiny_dir, num_blocks=64, weights=weights,
                     native_decode=False).generate(prompts, p)
        assert ([o.outputs[0].token_ids for o in native]
                == [o.outputs[0].token_ids for o in torch_]), weights


def test_quantized_weights_need_cpu_float32(tiny_dir):
    with pytest.raises(KilnError, match="float32"):
        LLM(tiny_dir, num_blocks=8, weights="int4", dtype="bfloat16", device="cpu")
    with pytest.raises(KilnError, match="int3"):
        LLM(tiny_dir, num_blocks=8, weights="int3")


@needs_smollm2
@needs_native
def test_smollm2_int4_greedy_equals_fp32():
    """SmolLM2's GGUF is Q4_1 (layers) + Q8_0 (embeddings): int4 (+ int8 LM head) holds the
    same values, so greedy decoding gives the FP32 model's tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fp32 = LLM(SMOLLM2, num_blocks=32).generate(prompts, p)
    int4 = LLM(SMOLLM2, num_blocks=32, weights="int4").generate(prompts, p)
    assert [o.outputs[0].token_ids for o in int4] == [o.outputs[0].token_ids for o in fp32]
