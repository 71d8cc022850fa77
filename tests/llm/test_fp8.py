"""FP8 e4m3 weights (per-channel scales): quantization, the torch GEMM paths (CPU), the model
end to end. The Triton FP8 GEMV is in test_triton_gemv.py (interpreter on the CPU)."""

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.llm import LLM, SamplingParams, fp8
from kiln.llm.attention import TorchPagedAttention, build_meta
from kiln.llm.config import ModelConfig
from kiln.llm.model import LlamaModel
from tests.llm.helpers import TINY, tiny_state_dict


def _needs_cpu_scaled_mm():
    """The CPU wheel here has a float32 rowwise _scaled_mm; the H200 machine's CUDA 13 build of
    torch 2.11 refused it on the CPU (2026-12-04): skip there, fail anywhere else."""
    got = fp8._scaled_mm_usable(torch.device("cpu"), torch.float32)
    if got is None and torch.cuda.is_available():
        pytest.skip("this CUDA build of torch has no CPU _scaled_mm")
    assert got == torch.float32  # the CPU torch has it


def test_quantize_keeps_each_row_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 80, generator=g) * torch.logspace(-3, 1, 24)[:, None]  # rows of scales
    w[5] = 0  # an all-zero row keeps scale 1 and codes 0
    q = fp8.quantize(w)
    assert q.q.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.shape == (24, 80) and q.nbytes() == 24 * 80 + 24 * 4
    d = q.dequantize()
    assert torch.equal(d[5], torch.zeros(80)) and q.scale[5] == 1
    amax = w.abs().amax(1)
    # each row's largest value maps to 448 exactly; the rest keep 3 mantissa bits: error of
    # a value v at most |v| / 16 (normal range) or half of e4m3's smallest step, 2^-10 * s
    assert torch.allclose(d.abs().amax(1), amax, rtol=1e-6)
    bound = torch.maximum(w.abs() / 16, 2.0 ** -10 * q.scale[:, None]) + 1e-12
    assert bool(((d - w).abs() <= bound).all())


def test_quantize_refuses_bad_weights():
    with pytest.raises(KilnError, match="2-D"):
        fp8.quantize(torch.ones(4))
    with pytest.raises(KilnError, match="finite"):
        fp8.quantize(torch.tensor([[1.0, float("inf")]]))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fp8_linear_matches_dequantized_gemm(rows):
    """_scaled_mm (x quantized per row too) and the dequantize fallback against the float32
    GEMM on the dequantized weight."""
    g = torch.Generator().manual_seed(rows)
    w = fp8.quantize(torch.randn(48, 64, generator=g) * 0.05)
    x = torch.randn(rows, 64, generator=g)
    b = torch.randn(48, generator=g)
    want = F.linear(x, w.dequantize(), b)
    saved = fp8._scaled_mm_ok.copy()
    fp8._scaled_mm_ok[("cpu", torch.float32)] = None
    try:
        torch.testing.assert_close(fp8.linear(x, w, b), want, rtol=1e-5, atol=1e-5)
    finally:
        fp8._scaled_mm_ok.clear()
        fp8._scaled_mm_ok.update(saved)
    _needs_cpu_scaled_mm()
    got = fp8.linear(x, w, b)
    # x in e4m3 adds |x| / 16 per element at most: a few percent of the row's scale
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_fp8_linear_takes_bfloat16_results_where_only_those_come(monkeypatch):
    _needs_cpu_scaled_mm()
    g = torch.Generator().manual_seed(9)
    w = fp8.quantize(torch.randn(32, 48, generator=g))
    x = torch.randn(4, 48, generator=g).half()
    real = torch._scaled_mm

    def bf16_only(*a, out_dtype=None, **kw):
        if out_dtype != torch.bfloat16:
            raise RuntimeError("Only bf16 high precision output types are supported")
        return real(*a, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", bf16_only)
    monkeypatch.delitem(fp8._scaled_mm_ok, ("cpu", torch.float16), raising=False)
    got = fp8.linear(x, w)
    assert fp8._scaled_mm_ok[("cpu", torch.float16)] == torch.bfloat16
    assert got.dtype == torch.float16
    want = F.linear(x.float(), w.dequantize())
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    fp8._scaled_mm_ok.pop(("cpu", torch.float16))


def test_fp8_linear_dequantizes_shapes_scaled_mm_refuses():
    w = fp8.quantize(torch.randn(10, 24))  # N, K not multiples of 16
    x = torch.randn(3, 24)
    torch.testing.assert_close(fp8.linear(x, w), F.linear(x, w.dequantize()))


def _tiny(weights):
    return LlamaModel(ModelConfig.from_hf(TINY), tiny_state_dict(TINY), "cpu", torch.float32,
                      weights)


def test_fp8_model_logits_close_to_fp32():
    """Every GEMM (LM head included) in FP8: a prefill of 9 tokens, logits near FP32's."""
    ref, q = _tiny("dtype"), _tiny("fp8")
    assert isinstance(q.layers[0].gate_up, fp8.Fp8Weight) and isinstance(q.lm_head,
                                                                         fp8.Fp8Weight)
    assert not q.native_decode_ok()
    c = ref.cfg
    ids = torch.tensor([5, 900, 17, 3, 44, 1000, 2, 8, 31])
    pos = torch.arange(9)
    meta = build_meta([(0, 9, [0, 1, 2])], 4, "cpu")
    out = []
    for m in (ref, q):
        cache = torch.zeros(c.num_layers, 2, 4, 4, c.num_kv_heads, c.head_dim)
        with torch.inference_mode():
            out.append(m.forward(ids, pos, TorchPagedAttention(cache, c.num_heads), meta, None))
    # e4m3 rounds each weight (and, in _scaled_mm, each activation) by up to 1/16: at K = 64
    # over two layers and the LM head that is ~10% of the logits' norm (a wrong scale: ~100%)
    err = (out[1] - out[0]).norm() / out[0].norm()
    assert err < 0.15, err
    assert (out[1].argmax(-1) == out[0].argmax(-1)).float().mean() >= 0.7


def test_fp8_engine_generates_and_mostly_agrees(tiny_dir):
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["Hello there", "The capital of France is"]
    ref = LLM(tiny_dir, num_blocks=32).generate(prompts, p)
    got = LLM(tiny_dir, num_blocks=32, weights="fp8").generate(prompts, p)
    assert all(len(o.outputs[0].token_ids) == 8 for o in got)
    first = [o.outputs[0].token_ids[0] for o in got]
    assert first == [o.outputs[0].token_ids[0] for o in ref]
