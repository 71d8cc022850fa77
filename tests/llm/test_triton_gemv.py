"""The Triton split-K GEMV against F.linear, and the CUDA runner's fallbacks (interpreter on
CPU)."""

import logging
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kiln.llm import fp8
from kiln.llm.triton_gemv import CONFIGS, FP8_CONFIGS, MAX_ROWS, gemv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", [(40, 96), (7, 1030), (33, 512)])  # ragged rows and K tails
def test_gemv_matches_linear(config, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(DEV)
    x = torch.randn(1, k, generator=g).to(DEV)
    b = torch.randn(n, generator=g).to(DEV)
    torch.testing.assert_close(gemv(x, w, b, config), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3]])  # one pass, and split-K 2
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_gemv_rows_match_linear(config, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(33, 300, generator=g).to(DEV)
    x = torch.randn(rows, 300, generator=g).to(DEV)
    torch.testing.assert_close(gemv(x, w, None, config), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", FP8_CONFIGS)
@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_gemv_matches_dequantized_linear(config, rows):
    """FP8 e4m3 codes widened in registers, times the row scales: the float32 GEMM on the
    dequantized weight (the same products, another summation order)."""
    g = torch.Generator().manual_seed(7 * rows)
    w = fp8.quantize(torch.randn(40, 1030, generator=g) * 0.03)  # ragged rows and K tail
    x = torch.randn(rows, 1030, generator=g)
    b = torch.randn(40, generator=g)
    want = F.linear(x, w.dequantize(), b)
    got = gemv(x.to(DEV), w.q.to(DEV), b.to(DEV), config, scale=w.scale.to(DEV)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fp8_gemv_half_activations():
    g = torch.Generator().manual_seed(3)
    w = fp8.quantize(torch.randn(16, 256, generator=g))
    x = torch.randn(2, 256, generator=g).half()
    got = gemv(x.to(DEV), w.q.to(DEV), None, CONFIGS[1], scale=w.scale.to(DEV)).cpu()
    assert got.dtype == torch.float16
    want = F.linear(x.float(), w.dequantize())
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-2)


def test_gemv_refuses_too_many_rows():
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.ones(MAX_ROWS + 1, 32), torch.ones(8, 32))
    with pytest.raises(ValueError, match="one"):
        gemv(torch.ones(2, 64), torch.ones(8, 32), silu_mul=True)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3]])
@pytest.mark.parametrize("weights", ["float32", "fp8"])
def test_silu_mul_gemv_matches_two_ops(config, weights):
    """down(silu(gate) * up) with the activation made in registers from a [gate | up] row."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(24, 300, generator=g) * 0.1
    gu = torch.randn(1, 600, generator=g) * 2
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) * up
    if weights == "fp8":
        q = fp8.quantize(w)
        want = F.linear(act, q.dequantize())
        got = gemv(gu.to(DEV), q.q.to(DEV), None, config, scale=q.scale.to(DEV),
                   silu_mul=True).cpu()
    else:
        want = F.linear(act, w)
        got = gemv(gu.to(DEV), w.to(DEV), None, config, silu_mul=True).cpu()
    assert got.shape == (1, 24)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _tiny_llm(tiny_dir, weights="dtype", **kw):
    from kiln.llm import LLM
    from kiln.llm.cuda_runner import CudaModelRunner

    llm = LLM(tiny_dir, num_blocks=32, weights=weights)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, **kw)
    return llm


PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3"]


def _want(tiny_dir, p):
    from kiln.llm import LLM

    return [o.outputs[0].token_ids for o in LLM(tiny_dir, num_blocks=32).generate(PROMPTS, p)]


def test_runner_with_triton_gemv_matches_torch_path(tiny_dir):
    from kiln.llm import SamplingParams

    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = _tiny_llm(tiny_dir)
    m = llm.engine.model
    for w in (m.layers[0].qkv, m.layers[0].o, m.layers[0].gate_up, m.layers[0].down):
        m.gemv[tuple(w.shape)] = CONFIGS[3]  # split-K 2
    calls = []
    import kiln.llm.triton_gemv as tg

    orig = tg.gemv

    def counted(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    tg.gemv = counted
    try:
        got = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]], p)]
    finally:
        tg.gemv = orig
    assert calls  # one-row decode steps went through the Triton GEMV
    from kiln.llm import LLM

    want = [o.outputs[0].token_ids for o in LLM(tiny_dir, num_blocks=32).generate([PROMPTS[0]], p)]
    assert got == want


def test_runner_sampling_path_matches_torch_path(tiny_dir):
    # a non-greedy step takes the logits (not the in-graph argmax); seeded, so comparable
    from kiln.llm import SamplingParams

    p = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in _tiny_llm(tiny_dir).generate(PROMPTS, p)]
    assert got == _want(tiny_dir, p)


def test_runner_falls_back_to_torch_when_triton_decode_fails(tiny_dir, monkeypatch, caplog):
    import kiln.llm.cuda_runner as cr
    from kiln.llm import SamplingParams

    def broken(*a, **kw):
        raise RuntimeError("triton: out of resources (simulated)")

    monkeypatch.setattr(cr, "paged_decode", broken)
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = _tiny_llm(tiny_dir)
    with caplog.at_level(logging.WARNING, logger="kiln.llm"):
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)]
    assert got == _want(tiny_dir, p)
    assert llm.engine.runner.describe()["decode"] == "torch"
    assert "decode runs the torch path" in caplog.text


def test_runner_drops_a_failing_gemv_first(tiny_dir, monkeypatch):
    import kiln.llm.triton_gemv as tg
    from kiln.llm import SamplingParams

    def broken(*a, **kw):
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(tg, "gemv", broken)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = _tiny_llm(tiny_dir)
    m = llm.engine.model
    m.gemv[tuple(m.layers[0].o.shape)] = CONFIGS[0]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], p)]  # one row: GEMV
    assert got == _want(tiny_dir, p)[:1]
    assert not m.gemv and llm.engine.runner.describe()["decode"] == "eager-triton"
    assert tuple(m.layers[0].o.shape) not in m.gemv


def test_runner_fp8_decode_through_triton_gemv(tiny_dir, monkeypatch):
    """An FP8 model whose GEMMs of up to MAX_ROWS rows run the Triton FP8 GEMV: the tokens of
    the same weights dequantized for torch GEMMs (weight-only both ways)."""
    from kiln.llm import LLM, SamplingParams

    monkeypatch.setitem(fp8._scaled_mm_ok, ("cpu", torch.float32), None)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = _tiny_llm(tiny_dir, weights="fp8")
    m = llm.engine.model
    for w in (m.layers[0].qkv, m.layers[0].o, m.layers[0].gate_up, m.layers[0].down):
        m.gemv[w.shape] = CONFIGS[1]  # (the LM head's 49152 rows are slow in the interpreter)
    import kiln.llm.triton_gemv as tg

    calls = []
    orig = tg.gemv
    monkeypatch.setattr(tg, "gemv", lambda *a, **kw: calls.append(kw["scale"]) or orig(*a, **kw))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], p)]
    assert len(calls) >= 4 * 2 * 3 and all(s is not None for s in calls)
    want = LLM(tiny_dir, num_blocks=32, weights="fp8").generate(PROMPTS[:2], p)
    assert got == [o.outputs[0].token_ids for o in want]


def test_runner_silu_mul_gemv_matches_torch_path(tiny_dir, monkeypatch):
    from kiln.llm import SamplingParams

    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = _tiny_llm(tiny_dir, fused_ops=True)
    m = llm.engine.model
    m.gemv_silu[tuple(m.layers[0].down.shape)] = CONFIGS[1]
    import kiln.llm.triton_gemv as tg

    calls = []
    orig = tg.gemv
    monkeypatch.setattr(tg, "gemv", lambda *a, **kw: calls.append(kw.get("silu_mul")) or orig(
        *a, **kw))
    got = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[1]], p)]
    assert calls.count(True) == 2 * 4  # two layers x four one-row decode steps
    assert got == _want(tiny_dir, p)[1:2]
