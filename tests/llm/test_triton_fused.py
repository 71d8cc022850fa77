"""The fused decode kernels (add + RMSNorm, SiLU * up, RoPE + KV write) against the torch ops
they replace, their fallback, and the CUDA runner with them on (interpreter on the CPU)."""

import logging
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kiln.llm import fused, triton_fused
from kiln.llm.fused import FusedOps

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm_matches_torch(dtype, residual):
    x, w = _randn(5, 96, seed=1, dtype=dtype), _randn(96, seed=2, dtype=dtype)
    r = _randn(5, 96, seed=3, dtype=dtype) if residual else None
    s, y = triton_fused.add_rms_norm(x, r, w, 1e-5)
    s_ref, y_ref = fused.add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)  # the same rounded sum
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_torch(dtype):
    gu = _randn(3, 200, seed=4, dtype=dtype) * 3
    got = triton_fused.silu_mul(gu, block=64)  # 100 columns: a ragged last block
    torch.testing.assert_close(got, fused.silu_mul(gu), **TOL[dtype])


def _rope_case(dtype, t=3, heads=4, kv=2, d=16, seed=5):
    from kiln.llm.config import ModelConfig, rope_inv_freq

    cfg = ModelConfig(vocab_size=10, hidden_size=heads * d, intermediate_size=8, num_layers=1,
                      num_heads=heads, num_kv_heads=kv, head_dim=d, max_position=64)
    inv, mscale = rope_inv_freq(cfg)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (emb.cos() * mscale).to(DEV, dtype), (emb.sin() * mscale).to(DEV, dtype)
    wide = _randn(t, (heads + 2 * kv) * d + 8, seed=seed, dtype=dtype)
    qkv = wide[:, 4:4 + (heads + 2 * kv) * d]  # rows strided, as a slice of a wider output
    positions = torch.tensor([7, 0, 63][:t], device=DEV)
    slots = torch.tensor([5, 30, 11][:t], device=DEV)
    caches = [_randn(40, kv, d, seed=seed + i, dtype=dtype) for i in (1, 2)]
    return qkv, cos, sin, positions, slots, caches, (heads, kv, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_matches_torch(dtype):
    qkv, cos, sin, positions, slots, (kc, vc), dims = _rope_case(dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = triton_fused.rope_kv(qkv, cos, sin, positions, slots, kc, vc, *dims)
    q_ref = fused.rope_kv(qkv, cos, sin, positions, slots, kc_ref, vc_ref, *dims)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(kc, kc_ref, **TOL[dtype])  # the rotated k in its slots
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)  # v copied as it is
    untouched = [i for i in range(40) if i not in slots.tolist()]
    assert torch.equal(kc[untouched], kc_ref[untouched])


@pytest.mark.parametrize("fp8_kv", [False, True])
def test_rope_kv_with_k_returns_the_rotated_k(fp8_kv):
    """with_k (a prefill attends over its fresh keys): the rotated k comes back unquantized in
    qkv's dtype, the same as the torch op's, beside the same q and cache bytes as without it."""
    from kiln.llm import kv_quant

    qkv, cos, sin, positions, slots, (kc, vc), dims = _rope_case(torch.float16)
    sc = torch.tensor([0.01, 0.02], device=DEV) if fp8_kv else None
    if fp8_kv:
        kc, vc = kc.to(kv_quant.FP8), vc.to(kv_quant.FP8)
    kc2, vc2, kc_ref, vc_ref = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q, k = triton_fused.rope_kv(qkv, cos, sin, positions, slots, kc, vc, *dims, sc,
                                with_k=True)
    q_ref, k_ref = fused.rope_kv(qkv, cos, sin, positions, slots, kc_ref, vc_ref, *dims, sc,
                                 with_k=True)
    q_plain = triton_fused.rope_kv(qkv, cos, sin, positions, slots, kc2, vc2, *dims, sc)
    assert k.shape == (3, dims[1], dims[2]) and k.dtype == qkv.dtype
    torch.testing.assert_close(k, k_ref, **TOL[torch.float16])
    torch.testing.assert_close(q, q_ref, **TOL[torch.float16])
    assert torch.equal(q, q_plain)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_fp8_cache_matches_torch(dtype):
    """An e4m3 cache: the kernel writes k / sk (rotated) and v / sv, saturated at 448, as the
    torch op's quantize does (equal codes but where the rotated k, rounded to FP16 first by the
    torch op and not by the kernel, sits on a tie: one e4m3 step then); a value past 448 * s
    saturates instead of turning NaN."""
    from kiln.llm import kv_quant

    qkv, cos, sin, positions, slots, _, dims = _rope_case(dtype)
    heads, kv, d = dims
    qkv = qkv.clone()
    qkv[0, (heads + kv) * d] = 1000.0  # a v element far past 448 * sv
    kc, vc = (torch.zeros(40, kv, d, device=DEV).to(kv_quant.FP8) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    sc = torch.tensor([0.01, 0.5], device=DEV)
    q = triton_fused.rope_kv(qkv, cos, sin, positions, slots, kc, vc, *dims, sc)
    q_ref = fused.rope_kv(qkv, cos, sin, positions, slots, kc_ref, vc_ref, *dims, sc)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    diff = kc.float() != kc_ref.float()
    assert diff.float().mean() < 0.01, diff.sum()  # a tie moved by k's rounding, at most
    # one e4m3 step is 1/8 of the value's power of two (subnormals: 2^-9)
    torch.testing.assert_close(kc.float(), kc_ref.float(), rtol=0.13, atol=2 ** -9)
    torch.testing.assert_close(vc.float(), vc_ref.float(), rtol=0, atol=0)
    assert vc[slots[0], 0, 0].float().item() == 448.0
    assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()
    untouched = [i for i in range(40) if i not in slots.tolist()]
    assert not kc[untouched].float().any()


def test_fused_op_falls_back_to_torch_for_good(monkeypatch, caplog):
    ops = FusedOps()
    x, w = _randn(2, 32, seed=6), _randn(32, seed=7)
    ops.add_rms_norm(x, x, w, 1e-5)  # loads the kernel table
    calls = []

    def broken(*a):
        calls.append(1)
        raise RuntimeError("out of resources (simulated)")

    monkeypatch.setitem(ops._kernels, "add_rms_norm", broken)
    with caplog.at_level(logging.WARNING, logger="kiln.llm"):
        got = ops.add_rms_norm(x, x, w, 1e-5)
        again = ops.add_rms_norm(x, x, w, 1e-5)
    want = fused.add_rms_norm(x, x, w, 1e-5)
    for g in (got, again):
        torch.testing.assert_close(g[1], want[1])
    assert calls == [1]  # off after the first failure
    assert ops.paths == {"add_rms_norm": "torch", "silu_mul": "triton", "rope_kv": "triton"}
    assert "torch ops instead" in caplog.text


def test_runner_with_fused_kernels_matches_torch_path(tiny_dir, monkeypatch):
    from kiln.llm import LLM, SamplingParams
    from kiln.llm.cuda_runner import CudaModelRunner

    prompts = ["Hello there", "The capital of France is", "1, 2, 3"]
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_dir, num_blocks=32).generate(prompts, p)]
    llm = LLM(tiny_dir, num_blocks=32)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, fused_ops=True)
    ran = []
    for op in fused.OPS:
        orig = getattr(triton_fused, op)
        monkeypatch.setattr(triton_fused, op,
                            lambda *a, _o=orig, _n=op: ran.append(_n) or _o(*a))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert got == want
    assert set(ran) == set(fused.OPS)  # every fused kernel ran (rope_kv in decode steps)
    assert eng.runner.describe()["fused"] == {op: "triton" for op in fused.OPS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_rows_matches_the_torch_ops(dtype):
    """The FP8 GEMMs' activation quantize in one kernel: the torch ops' scales and e4m3 codes
    (strided rows, K past the block, an all-zero row with scale 1, a row with one large
    value); on a GPU, whose division may round differently, codes within one e4m3 step."""
    from kiln.llm import fp8

    wide = _randn(5, 108, seed=11, dtype=dtype)
    wide[2] = 0
    wide[3, 7] = 300.0
    x = wide[:, 3:103]  # 100 columns of 108-wide rows
    q, sx = triton_fused.quantize_rows(x, block=32)
    q_ref, sx_ref = fp8.quantize_rows_torch(x)
    assert q.dtype == torch.float8_e4m3fn and sx.shape == (5, 1) and q.is_contiguous()
    torch.testing.assert_close(sx, sx_ref, rtol=1e-6, atol=0)
    assert sx[2].item() == 1.0 and not q[2].float().any()
    if DEV == "cpu":
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    else:
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.13, atol=2 ** -9)
    torch.testing.assert_close(q.float() * sx, x.float(), rtol=0.07, atol=2 ** -9 * 300 / 448)
