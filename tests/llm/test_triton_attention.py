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
    _check_paged_decode(heads, kv, splits, lens)


@pytest.mark.parametrize("tile", [8, (32, 8), 64, (32, 4, 2), (8, 4, "pf"), (32, 4, 2, "pf"),
                                  (64, 4, "pf")])  # within a block, two blocks (8 warps), past
# the longest sequence, 2 pipeline stages; the same with the next tile prefetched
@pytest.mark.parametrize("splits,lens", [(1, [33, 5]), (3, [1, 17, 40]), (4, [64, 16])])
def test_paged_decode_tiled_mha_matches_sdpa(tile, splits, lens):
    """The MHA variant: tiles of ``tile`` tokens across block boundaries, splits rounded to
    tiles (some empty), the GQA case still on the tl.dot kernel."""
    _check_paged_decode(3, 3, splits, lens, tile=tile)
    _check_paged_decode(4, 2, splits, lens, tile=tile)  # GQA: mha_tile ignored


@pytest.mark.parametrize("dot_tile,bs", [(32, 16), ((64, 8), 16), (16, 32), ((64, 4, 2), 4)])
# tiles over 2 and 4 blocks (8 warps), half a block of 32, 16 blocks of 4 (2 pipeline stages)
@pytest.mark.parametrize("splits,lens", [(1, [33, 5]), (3, [1, 17, 40])])
def test_paged_decode_dot_tile_matches_sdpa(dot_tile, bs, splits, lens):
    """The tl.dot kernel with ``dot_tile`` tokens an iteration, each token's block looked up on
    its own (a tile across blocks, or within one), GQA and MHA."""
    _check_paged_decode(4, 2, splits, lens, dot_tile=dot_tile, bs=bs)
    _check_paged_decode(3, 3, splits, lens, dot_tile=dot_tile, bs=bs)


def test_paged_decode_refuses_a_bad_dot_tile():
    c = torch.zeros(2, 16, 1, 16, device=DEV)
    q = torch.zeros(1, 1, 16, device=DEV)
    for bad in (8, 48):
        with pytest.raises(ValueError, match=f"dot_tile {bad}: a power of two"):
            paged_decode(q, c, c, torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                         torch.ones(1, dtype=torch.int32, device=DEV), 0.25, dot_tile=bad)


def _scattered_tables(lens, bs: int, blocks: int, g) -> torch.Tensor:
    """Block tables for sequences of ``lens`` tokens over a random permutation of the
    ``blocks`` (scattered, non-increasing block ids); int32 [seqs, max blocks] on the CPU."""
    perm = torch.randperm(blocks, generator=g)
    need = [-(-n // bs) for n in lens]
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    return tables


def _check_paged_decode(heads, kv, splits, lens, tile=None, dot_tile=None, bs=16):
    g = torch.Generator().manual_seed(0)
    d, blocks = 16, 12 * 16 // bs
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    kc = torch.randn(blocks, bs, kv, d, generator=g).to(DEV, dtype)
    vc = torch.randn(blocks, bs, kv, d, generator=g).to(DEV, dtype)
    tables = _scattered_tables(lens, bs, blocks, g)
    q = torch.randn(len(lens), heads, d, generator=g).to(DEV, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    got = paged_decode(q, kc, vc, tables.to(DEV), lens_t, d ** -0.5, splits=splits,
                       mha_tile=tile, dot_tile=dot_tile)
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


def test_cuda_runner_kq_decode_matches_torch_path(tiny_dir):
    """Decode steps (and mixed steps' decode rows) on the K . q^T kernel: the torch path's
    greedy tokens (GQA tiny Llama, FP32 on the CPU)."""
    from kiln.llm import LLM, SamplingParams
    from kiln.llm.cuda_runner import CudaModelRunner
    from kiln.llm.triton_attention import KQ

    prompts = ["Hello there", "The capital of France is", "1, 2, 3"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_dir, num_blocks=32).generate(prompts, p)]
    llm = LLM(tiny_dir, num_blocks=32, max_num_batched_tokens=8)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, dot_tile=(32, 4, KQ))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert got == want and eng.runner.describe()["dot_tile"] == (32, 4, KQ)


def test_decode_splits_fill_the_gpu_then_stop():
    from kiln.llm.triton_attention import decode_splits

    assert decode_splits(1, 32) == 8  # Llama-2-7B at batch 1: 32 programs alone
    assert decode_splits(16, 32) == 2
    assert decode_splits(256, 32) == 1  # 8192 programs already
    assert decode_splits(64, 8) == 2  # GQA: fewer KV heads, more splits
    assert all(1 <= decode_splits(b, kv) <= 8 for b in (1, 3, 1000) for kv in (1, 8, 64))


@pytest.mark.parametrize("heads,kv,splits,lens,calibrated,tile", [
    (4, 2, 3, [1, 17, 40], False, None),  # GQA 2, scale 1.0 (vLLM's default)
    (3, 3, 2, [33, 5], True, None),  # MHA, scales from the amax
    (3, 3, 2, [33, 5], True, 32),  # MHA, the tiled kernel
    (6, 1, 4, [64, 16], True, None),  # MQA
    (4, 2, 1, [1, 17, 40], True, None),  # one split: the output written by the split kernel
    (3, 3, 1, [33, 5], True, 32),
    (3, 3, 2, [33, 5], True, (16, 4, "pf")),  # the tiled kernel, next tile prefetched
])
def test_paged_decode_fp8_cache(heads, kv, splits, lens, calibrated, tile):
    """An e4m3 cache with per-tensor K/V scales: the kernel (FP8 tiles widened in registers,
    the scales folded in) equals attention over the dequantized cache to float rounding, and
    the unquantized cache within e4m3's error."""
    from kiln.llm import kv_quant

    g = torch.Generator().manual_seed(1)
    d, bs, blocks = 16, 16, 12
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    k32 = torch.randn(blocks, bs, kv, d, generator=g) * 2
    v32 = torch.randn(blocks, bs, kv, d, generator=g) * 0.5
    sc = torch.tensor([1.0, 1.0])
    if calibrated:
        sc = torch.stack([k32.abs().amax(), v32.abs().amax()]) / kv_quant.FP8_MAX
    k8, v8 = kv_quant.quantize(k32, sc[0]), kv_quant.quantize(v32, sc[1])
    tables = _scattered_tables(lens, bs, blocks, g)
    q = torch.randn(len(lens), heads, d, generator=g).to(DEV, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    tables = tables.to(DEV)
    got = paged_decode(q, k8.to(DEV), v8.to(DEV), tables, lens_t, d ** -0.5, splits=splits,
                       kv_scale=sc.to(DEV), mha_tile=tile).float()
    deq = reference(q, (k8.float() * sc[0]).to(DEV), (v8.float() * sc[1]).to(DEV), tables,
                    lens_t, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got, deq, rtol=tol, atol=tol)
    exact = reference(q, k32.to(DEV), v32.to(DEV), tables, lens_t, d ** -0.5)
    # e4m3 keeps 3 mantissa bits (relative error up to 1/16 per element); averaged over the
    # context the output moves by a few percent of V's scale
    err = (got - exact).abs().max().item() / v32.abs().max().item()
    assert err < 0.06, err


def test_paged_decode_refuses_fp8_cache_without_scales():
    from kiln.llm import kv_quant

    c = torch.zeros(2, 16, 1, 16).to(kv_quant.FP8).to(DEV)
    q = torch.zeros(1, 1, 16, device=DEV)
    with pytest.raises(ValueError, match="kv_scale"):
        paged_decode(q, c, c, torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                     torch.ones(1, dtype=torch.int32, device=DEV), 0.25)


@pytest.mark.parametrize("fused_ops", [False, True])
def test_cuda_runner_fp8_kv_keeps_fp32_kv_tokens(tiny_dir, fused_ops):
    """The CUDA runner over an FP8 cache with calibrated scales (Triton decode reading e4m3,
    the RoPE + KV-write kernel quantizing, whole prompts attending to their fresh K/V), no
    graphs: the first tokens of the FP32-cache torch path."""
    from kiln.llm import LLM, SamplingParams
    from kiln.llm.cuda_runner import CudaModelRunner

    prompts = ["Hello there", "The capital of France is", "1, 2, 3"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_dir, num_blocks=32).generate(prompts, p)]
    llm = LLM(tiny_dir, num_blocks=32)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, fused_ops=fused_ops, kv_cache_dtype="fp8",
                                 calculate_kv_scales=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert [g[:4] for g in got] == [w[:4] for w in want]
    d = eng.runner.describe()
    assert d["kv_cache_dtype"] == "float8_e4m3fn" and d["calculated"], d
    assert d["decode"] == "eager-triton"  # no fallback to the torch path


def test_decode_tile_from_env(monkeypatch):
    from kiln.llm.triton_attention import mha_tile_from_env

    monkeypatch.delenv("KILN_LLM_DECODE_TILE", raising=False)
    assert mha_tile_from_env() is None
    monkeypatch.setenv("KILN_LLM_DECODE_TILE", "0")
    assert mha_tile_from_env() is None
    monkeypatch.setenv("KILN_LLM_DECODE_TILE", "64")
    assert mha_tile_from_env() == (64, 4)
    monkeypatch.setenv("KILN_LLM_DECODE_TILE", "32:8")
    assert mha_tile_from_env() == (32, 8)
    for bad in ("48", "64:3", "x"):
        monkeypatch.setenv("KILN_LLM_DECODE_TILE", bad)
        with pytest.raises(ValueError, match=f"KILN_LLM_DECODE_TILE={bad}: N or N:W"):
            mha_tile_from_env()


def test_dot_tile_from_env(monkeypatch):
    from kiln.llm.triton_attention import dot_tile_from_env

    monkeypatch.delenv("KILN_LLM_DECODE_DOT_TILE", raising=False)
    assert dot_tile_from_env() is None
    monkeypatch.setenv("KILN_LLM_DECODE_DOT_TILE", "64")
    assert dot_tile_from_env() == (64, 4)
    monkeypatch.setenv("KILN_LLM_DECODE_DOT_TILE", "128:8")
    assert dot_tile_from_env() == (128, 8)
    for bad in ("8", "48", "64:3"):  # tl.dot needs 16 rows at least
        monkeypatch.setenv("KILN_LLM_DECODE_DOT_TILE", bad)
        with pytest.raises(ValueError, match=f"KILN_LLM_DECODE_DOT_TILE={bad}: .*at least 16"):
            dot_tile_from_env()


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory):
    """The tiny Llama with as many KV heads as query heads (MHA, as Llama-2-7B)."""
    from tests.llm.conftest import SMOLLM2
    from tests.llm.helpers import TINY, tiny_state_dict, write_hf_dir

    cfg = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]}
    if SMOLLM2 is not None:
        from kiln.llm.gguf import GGUFFile
        from kiln.llm.tokenizer import from_gguf

        tok = from_gguf(GGUFFile(SMOLLM2).metadata)
    else:
        from bench.llm import placeholder_tokenizer

        tok = placeholder_tokenizer(cfg["vocab_size"])
        tok.chat_template = ""
    return write_hf_dir(tmp_path_factory.mktemp("tiny-mha"), cfg, tiny_state_dict(cfg), tok)


@pytest.mark.parametrize("kv_dtype,tile", [("auto", (32, 4)), ("fp8", (32, 4)),
                                           ("auto", (32, 4, "pf"))])
def test_cuda_runner_tiled_mha_decode(mha_dir, kv_dtype, tile, monkeypatch):
    """An MHA model's decode steps in the tiled kernel (decode_tile=(32, 4), and with the next
    tile prefetched), fused kernels on: the torch path's tokens (FP32 cache on the CPU: all 6;
    FP8 with calibrated scales, or FP16 on a GPU: the first 4)."""
    from kiln.llm import LLM, SamplingParams, cuda_runner
    from kiln.llm.cuda_runner import CudaModelRunner

    tiled = []

    def spy(q, k_cache, *a, mha_tile=None, **kw):
        tiled.append(mha_tile if q.shape[1] == k_cache.shape[2] else None)
        return paged_decode(q, k_cache, *a, mha_tile=mha_tile, **kw)

    monkeypatch.setattr(cuda_runner, "paged_decode", spy)

    prompts = ["Hello there", "The capital of France is", "1, 2, 3"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(mha_dir, num_blocks=32).generate(prompts, p)]
    llm = LLM(mha_dir, num_blocks=32)
    eng = llm.engine
    eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                 max_model_len=256, fused_ops=True, kv_cache_dtype=kv_dtype,
                                 calculate_kv_scales=True, decode_tile=tile)
    tiled.clear()  # on a GPU the engines above tune, warm up and decode in other kernels
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    n = 6 if kv_dtype == "auto" and DEV == "cpu" else 4
    assert [g[:n] for g in got] == [w[:n] for w in want]
    d = eng.runner.describe()
    assert d["decode_tile"] == tile and d["decode"] == "eager-triton", d
    assert tiled and all(t == tile for t in tiled)  # every decode call: MHA, tiled


@pytest.mark.parametrize("kv_dtype,env,want", [
    ("fp8", None, (128, 4)),  # an FP8 cache: the tiled kernel by default
    ("auto", None, None),     # FP16/FP32: the tl.dot kernel
    ("fp8", "0", None),       # the environment still decides when set
    ("auto", "64:8", (64, 8)),
])
def test_cuda_runner_default_decode_tile(mha_dir, kv_dtype, env, want, monkeypatch):
    from kiln.llm import LLM
    from kiln.llm.cuda_runner import CudaModelRunner

    if env is None:
        monkeypatch.delenv("KILN_LLM_DECODE_TILE", raising=False)
    else:
        monkeypatch.setenv("KILN_LLM_DECODE_TILE", env)
    eng = LLM(mha_dir, num_blocks=8).engine
    r = CudaModelRunner(eng.model, 8, eng.config.block_size, cuda_graphs=False,
                        max_model_len=64, fused_ops=False, tune_gemv=False,
                        kv_cache_dtype=kv_dtype)
    assert r.decode_tile == want


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_tune_decode_keeps_the_fastest_that_runs(mha_dir, kv_dtype, monkeypatch):
    """_tune_decode times each candidate on layer 0 of the real cache and keeps the fastest
    (here a fake clock makes dot32:4 fastest); a candidate that fails is a row, never picked;
    decode steps then run the pick and give the torch path's tokens."""
    from kiln.llm import LLM, SamplingParams, cuda_runner
    from kiln.llm.cuda_runner import CudaModelRunner

    used = []

    def spy(*a, mha_tile=None, dot_tile=None, **kw):
        used.append((mha_tile, dot_tile))
        return paged_decode(*a, mha_tile=mha_tile, dot_tile=dot_tile, **kw)

    monkeypatch.setattr(cuda_runner, "paged_decode", spy)
    prompts = ["Hello there", "1, 2, 3"]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(mha_dir, num_blocks=32).generate(prompts, p)]
    llm = LLM(mha_dir, num_blocks=32)
    eng = llm.engine
    r = eng.runner = CudaModelRunner(eng.model, 32, eng.config.block_size, cuda_graphs=False,
                                     max_model_len=256, fused_ops=False, kv_cache_dtype=kv_dtype,
                                     tune_decode=False)
    assert r.decode_tune == "off"
    used.clear()
    clock = [0.0]

    def fake_clock():  # every call of the dot32 configuration costs 1 s, the others 3 s
        last = used[-1] if used else (None, None)
        clock[0] += 1.0 if last == (None, (32, 4)) else 3.0
        return clock[0]

    cands = [("dot16:4", None, (16, 4)), ("dot32:4", None, (32, 4)), ("bad", None, (8, 4)),
             ("tile64:4", (64, 4), None)]
    r._tune_decode(batch=2, ctx=40, candidates=cands, iters=1, warmup=1, clock=fake_clock)
    t = r.describe()["decode_tune"]
    assert t["picked"] == "dot32:4" and (t["batch"], t["ctx"]) == (2, 40), t
    assert isinstance(t["us"]["dot16:4"], float) and "ValueError" in t["us"]["bad"]
    assert (r.attn.mha_tile, r.attn.dot_tile) == (None, (32, 4))
    assert r.describe()["dot_tile"] == (32, 4)
    used.clear()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    n = 4 if kv_dtype == "auto" and DEV == "cpu" else 2
    assert [g[:n] for g in got] == [w[:n] for w in want]
    assert used and all(u == (None, (32, 4)) for u in used)


def test_decode_candidates_by_model(mha_dir, tiny_dir):
    """MHA models time the tl.dot and the tiled kernel, GQA models the tl.dot kernel only;
    a third number is the pipelining depth (num_stages)."""
    from kiln.llm import LLM
    from kiln.llm.cuda_runner import CudaModelRunner

    names = {}
    for key, d in (("mha", mha_dir), ("gqa", tiny_dir)):
        eng = LLM(d, num_blocks=8).engine
        r = CudaModelRunner(eng.model, 8, eng.config.block_size, cuda_graphs=False,
                            max_model_len=64, fused_ops=False, tune_gemv=False,
                            tune_decode=False)
        names[key] = [c[0] for c in r.decode_candidates()]
    assert "dot64:4" in names["gqa"] and "dot64:4:s2" in names["gqa"]
    assert "kq64:4" in names["gqa"] and "kq128:4" in names["gqa"]
    assert not any(n.startswith("tile") for n in names["gqa"])
    assert "tile128:4" in names["mha"] and "tile128:4:s4" in names["mha"]
    assert "tile64:4:pf" in names["mha"] and "tile128:4:pf" in names["mha"]
    assert set(names["gqa"]) < set(names["mha"])


@pytest.mark.parametrize("dot_tile,bs", [((32, 4, "kq"), 16), ((64, 4, 2, "kq"), 4),
                                         ((16, 4, "kq"), 32)])
@pytest.mark.parametrize("splits,lens", [(1, [33, 5]), (3, [1, 17, 40])])
def test_paged_decode_kq_matches_sdpa(dot_tile, bs, splits, lens):
    """The K . q^T variant of the tl.dot kernel (tiles across blocks, within one, 2 stages):
    GQA, MHA and MQA against SDPA."""
    _check_paged_decode(4, 2, splits, lens, dot_tile=dot_tile, bs=bs)
    _check_paged_decode(3, 3, splits, lens, dot_tile=dot_tile, bs=bs)
    _check_paged_decode(6, 1, splits, lens, dot_tile=dot_tile, bs=bs)


@pytest.mark.parametrize("heads,kv", [(4, 2), (3, 3)])
def test_paged_decode_kq_fp8_cache_equals_dot(heads, kv):
    """Over an e4m3 cache the K . q^T kernel gives the q . K^T kernel's output to float
    rounding."""
    from kiln.llm import kv_quant

    g = torch.Generator().manual_seed(3)
    d, bs, blocks, lens = 16, 16, 12, [33, 5, 70]
    k8 = kv_quant.quantize(torch.randn(blocks, bs, kv, d, generator=g) * 2, torch.tensor(0.01))
    v8 = kv_quant.quantize(torch.randn(blocks, bs, kv, d, generator=g), torch.tensor(0.005))
    sc = torch.tensor([0.01, 0.005], device=DEV)
    tables = _scattered_tables(lens, bs, blocks, g).to(DEV)
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    q = torch.randn(len(lens), heads, d, generator=g).to(DEV, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    args = (q, k8.to(DEV), v8.to(DEV), tables, lens_t, d ** -0.5)
    want = paged_decode(*args, splits=2, kv_scale=sc, dot_tile=(32, 4)).float()
    got = paged_decode(*args, splits=2, kv_scale=sc, dot_tile=(32, 4, "kq")).float()
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dot_tile,tile", [(None, None), ((32, 4, "kq"), None), (None, 32),
                                           (None, (16, 4, "pf"))])
def test_one_split_launches_no_reduction(dot_tile, tile, monkeypatch):
    """splits == 1: the split kernel (each variant) writes the output, the reduction is not
    launched, and the output equals the reduced one (splits 2) to float rounding."""
    from kiln.llm import triton_attention as ta

    launched = []
    real = ta._decode_reduce

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(ta, "_decode_reduce", Spy())
    g = torch.Generator().manual_seed(5)
    d, bs, lens = 16, 16, [33, 5, 1]
    kc = torch.randn(12, bs, 3, d, generator=g).to(DEV)
    vc = torch.randn(12, bs, 3, d, generator=g).to(DEV)
    tables = _scattered_tables(lens, bs, 12, g).to(DEV)
    q = torch.randn(len(lens), 3, d, generator=g).to(DEV)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kw = dict(mha_tile=tile, dot_tile=dot_tile)
    one = paged_decode(q, kc, vc, tables, lens_t, d ** -0.5, splits=1, **kw)
    assert not launched
    two = paged_decode(q, kc, vc, tables, lens_t, d ** -0.5, splits=2, **kw)
    assert len(launched) == 1
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one.float(), reference(q, kc, vc, tables, lens_t, d ** -0.5),
                               rtol=1e-4, atol=1e-4)
