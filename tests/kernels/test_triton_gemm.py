import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.registry import kernels_for
from kiln.kernels.triton import gemm as G
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N
from tests.kernels.triton_util import assert_close, call, dot_dtypes, gpu, randn

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "SPLIT_K": 1,
         "num_warps": 1, "num_stages": 1}
SPLIT = dict(SMALL, SPLIT_K=2, GROUP_M=1)
CUBLAS = {"impl": "cublas", "BLOCK": 64, "num_warps": 1}  # cuBLAS, then the Triton epilogue
FLAT = dict(CUBLAS, flat=1)  # ... over the output as one run of elements (240: a partial block)

# the torch activations the fused epilogue must reproduce (alpha, beta as the op's attributes)
ACT = {"": lambda y: y, "Relu": torch.relu, "Gelu": F.gelu, "Silu": F.silu,
       "GeluTanh": lambda y: F.gelu(y, approximate="tanh"), "Sigmoid": torch.sigmoid,
       "Tanh": torch.tanh, "HardSwish": F.hardswish,
       "Clip": lambda y: y.clamp(-0.5, 0.5), "LeakyRelu": lambda y: F.leaky_relu(y, 0.5)}


@pytest.mark.parametrize("tactic", [None, SMALL, SPLIT, CUBLAS, FLAT],
                         ids=["default", "small", "splitk", "cublas", "flat"])
@pytest.mark.parametrize("act", sorted(ACT))
def test_triton_fused_matmul_epilogue(act, tactic):
    x, w = randn(2, 5, 40, dtype=torch.float16), randn(40, 24, dtype=torch.float16)
    b, r = randn(24, dtype=torch.float16), randn(2, 5, 24, dtype=torch.float16)
    n = call(FC.FusedMatMul, tactic, activation=act, alpha=-0.5 if act == "Clip" else 0.5,
             beta=0.5, has_residual=1)
    assert G._matmul_supports(n, (x, w, b, r))
    y = G.fused_matmul(n, x, w, b, r)
    want = ACT[act](x.float() @ w.float() + b.float() + r.float())
    assert y.dtype == torch.float16 and y.shape == (2, 5, 24)
    assert_close(y, want, scale=3)


@pytest.mark.parametrize("dtype", dot_dtypes(torch.float16, torch.bfloat16))
def test_triton_matmul_plain(dtype):
    a, b = randn(33, 20, dtype=dtype), randn(20, 17, dtype=dtype)
    y = G.matmul(call(N.MatMul, SMALL), a, b)
    assert y.dtype == dtype
    assert_close(y, a.float() @ b.float(), scale=3)


@pytest.mark.parametrize("trans", [(0, 0), (1, 1), (0, 1)])
def test_triton_gemm_transposes_alpha_beta(trans):
    ta, tb = trans
    a = randn(*((20, 7) if ta else (7, 20)), dtype=torch.float16)
    b = randn(*((24, 20) if tb else (20, 24)), dtype=torch.float16)
    c = randn(24, dtype=torch.float16)
    n = call(N.Gemm, SMALL, transA=ta, transB=tb, alpha=0.5, beta=2.0)
    y = G.gemm(n, a, b, c)
    af, bf = (a.float().t() if ta else a.float()), (b.float().t() if tb else b.float())
    assert_close(y, 0.5 * af @ bf + 2 * c.float(), scale=3)


@pytest.mark.parametrize("act,tactic,full_c", [
    ("Relu", "lt", False), ("GeluTanh", "lt", False), ("Gelu", "cublas", False),
    ("Relu", "flat", True), ("", "cublas", True)])
def test_triton_fused_gemm_cublas_tactics(act, tactic, full_c, monkeypatch):
    """FusedGemm (transB, as HF's Conv1D and torch's Linear export it): cuBLASLt's fused
    bias + ReLU / tanh-GELU, cuBLAS + the Triton pass (a bias row, or a full C as the
    residual); against the written-out product."""
    a, bt = randn(9, 20, dtype=torch.float16), randn(12, 20, dtype=torch.float16)
    c = randn(9, 12, dtype=torch.float16) if full_c else randn(12, dtype=torch.float16)
    t = {"lt": G.CUBLASLT_TACTIC, "flat": FLAT, "cublas": CUBLAS}[tactic]
    n = call(FC.FusedGemm, t, activation=act, transB=1)
    space = G._fused_gemm_tactics(n, (a, bt, c))
    assert any(x.get("impl") == t["impl"] and bool(x.get("flat")) == bool(t.get("flat"))
               for x in space)  # (the test's own blocks are smaller)
    assert any(x.get("impl") == "cublaslt" for x in space) == (act in G.LT_ACTS
                                                               and not full_c)
    seen = []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *x, **k: seen.append(k) or real(*x, **k))
    y = G.fused_gemm(n, a, bt, c)
    assert bool(seen) == (tactic == "lt")
    assert_close(y, ACT[act](a.float() @ bt.float().t() + c.float()), scale=3)


def test_triton_fused_gemm_no_cublas_with_trans_a():
    a, b, c = randn(20, 9, dtype=torch.float16), randn(20, 12, dtype=torch.float16), \
        randn(12, dtype=torch.float16)
    n = call(FC.FusedGemm, activation="Relu", transA=1)
    assert not [t for t in G._fused_gemm_tactics(n, (a, b, c)) if "impl" in t]
    k = [k for k in kernels_for(FC.FusedGemm, "cuda") if k.name == "TritonFusedGemm"][0]
    assert k.library(G.CUBLASLT_TACTIC) == "cublas" and k.library(None) is None


def test_triton_fused_gemm_full_c_is_a_residual():
    a, b = randn(9, 20, dtype=torch.float16), randn(20, 12, dtype=torch.float16)
    c = randn(9, 12, dtype=torch.float16)
    y = G.fused_gemm(call(FC.FusedGemm, SPLIT, activation="Relu"), a, b, c)
    assert_close(y, torch.relu(a.float() @ b.float() + c.float()), scale=3)


def test_triton_matmul_falls_back_for_fp32_and_batched():
    a, b = randn(3, 4), randn(4, 5)
    n = call(N.MatMul)
    assert not G._matmul_supports(n, (a, b))
    torch.testing.assert_close(G.matmul(n, a, b), a @ b)
    a3, b3 = randn(2, 3, 4, dtype=torch.float16), randn(2, 4, 5, dtype=torch.float16)
    assert not G._matmul_supports(n, (a3, b3))


def test_triton_fused_matmul_offers_cublas_only_with_an_epilogue():
    """The cuBLAS + Triton-epilogue tactics are offered where there is an epilogue to run
    (an activation or a residual; the bias rides in cuBLASLt) and say they load cuBLAS; a plain
    product (the PyTorch kernel is that already) gets the Triton tiles alone."""
    x, w, b = randn(4, 32, dtype=torch.float16), randn(32, 16, dtype=torch.float16), \
        randn(16, dtype=torch.float16)
    k = [k for k in kernels_for(FC.FusedMatMul, "cuda") if k.name == "TritonFusedMatMul"][0]
    gelu = k.tactic_space(call(FC.FusedMatMul, activation="Gelu"), (x, w, b))
    assert [t for t in gelu if t.get("impl") == "cublas"] == list(G.CUBLAS_TACTICS)
    assert all(k.library(t) == "cublas" for t in gelu if t.get("impl") == "cublas")
    assert all(k.library(t) is None for t in gelu if "impl" not in t)
    plain = k.tactic_space(call(FC.FusedMatMul), (x, w, b))
    assert plain and not any(t.get("impl") == "cublas" for t in plain)
    res = k.tactic_space(call(FC.FusedMatMul, has_residual=1), (x, w, b, randn(4, 16,
                                                                             dtype=torch.float16)))
    assert any(t.get("impl") == "cublas" for t in res)


@pytest.mark.parametrize("act", ["Relu", "GeluTanh"])
def test_triton_fused_matmul_cublaslt_epilogue(act, monkeypatch):
    """Bias + ReLU / tanh-GELU in cuBLASLt's own epilogue (torch._addmm_activation): one call,
    no Triton pass, the torch reference's numbers."""
    x, w = randn(2, 5, 40, dtype=torch.float16), randn(40, 24, dtype=torch.float16)
    b = randn(24, dtype=torch.float16)
    n = call(FC.FusedMatMul, G.CUBLASLT_TACTIC, activation=act)
    seen, passes = [], []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *a, **k: seen.append(k) or real(*a, **k))
    monkeypatch.setattr(G, "rows_act_", lambda *a, **k: passes.append(a))
    y = G.fused_matmul(n, x, w, b)
    assert seen == [{"use_gelu": act == "GeluTanh"}] and not passes
    want = ACT[act](x.float() @ w.float() + b.float())
    assert y.dtype == torch.float16 and y.shape == (2, 5, 24)
    assert_close(y, want, scale=3)


def test_triton_fused_matmul_cublaslt_only_where_it_computes_the_op(monkeypatch):
    """cuBLASLt's epilogue is offered for ReLU and tanh-GELU with a bias and no residual; not
    for the erf GELU (cuBLASLt's GELU is the tanh form), nor with a residual (it would come
    after the activation), nor without a bias. Forced on such a node, the tactic runs the exact
    epilogue instead."""
    x, w, b = randn(4, 32, dtype=torch.float16), randn(32, 16, dtype=torch.float16), \
        randn(16, dtype=torch.float16)
    r = randn(4, 16, dtype=torch.float16)
    k = [k for k in kernels_for(FC.FusedMatMul, "cuda") if k.name == "TritonFusedMatMul"][0]

    def lt(inputs, **attrs):
        space = k.tactic_space(call(FC.FusedMatMul, **attrs), inputs)
        return [t for t in space if t.get("impl") == "cublaslt"]

    assert lt((x, w, b), activation="Relu") == [G.CUBLASLT_TACTIC]
    assert lt((x, w, b), activation="GeluTanh") == [G.CUBLASLT_TACTIC]
    assert k.library(G.CUBLASLT_TACTIC) == "cublas"
    assert not lt((x, w, b), activation="Gelu")
    assert not lt((x, w, b, r), activation="Relu", has_residual=1)
    assert not lt((x, w), activation="Relu")
    assert not lt((x, w, b))
    seen = []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    y = G.fused_matmul(call(FC.FusedMatMul, G.CUBLASLT_TACTIC, activation="Gelu"), x, w, b)
    y2 = G.fused_matmul(call(FC.FusedMatMul, G.CUBLASLT_TACTIC, activation="Relu",
                             has_residual=1), x, w, b, r)
    assert not seen
    assert_close(y, F.gelu(x.float() @ w.float() + b.float()), scale=3)
    assert_close(y2, torch.relu(x.float() @ w.float() + b.float() + r.float()), scale=3)


def test_triton_flat_epilogue_no_ops():
    """The flat pass: an empty output launches nothing; nothing to do is a no-op."""
    from kiln.kernels.triton import common
    y = torch.empty((0, 8), dtype=torch.float16, device=randn(1).device)
    assert common.rows_act_(y, None, "Relu", flat=True) is y
    z = randn(3, 8, dtype=torch.float16)
    before = z.clone()
    assert common.rows_act_(z, None, "", flat=True) is z and torch.equal(z, before)
    with pytest.raises(ValueError, match="contiguous"):
        common.rows_act_(z.t(), None, "Relu", flat=True)


def test_triton_gemm_tactic_space():
    big = G.gemm_tactics(8192, 768, 3072)
    assert all(t["SPLIT_K"] == 1 for t in big)  # 8192x768 fills the GPU: no split-K
    assert any(t["num_stages"] > 2 for t in big)  # 48 K steps and more: pipelined
    # ResNet-50's 64 -> 256 1x1 conv at b256: one K step for BLOCK_K 64, two for 32
    short = G.gemm_tactics(256 * 56 * 56, 256, 64)
    assert short and all(t["num_stages"] == (1 if t["BLOCK_K"] >= 64 else 2) for t in short)
    for m, n, k in ((802816, 512, 128), (16, 768, 2304), (4096, 64, 96)):
        assert all(t["num_stages"] <= -(-k // (t["BLOCK_K"] * t["SPLIT_K"]))
                   for t in G.gemm_tactics(m, n, k))
    small = G.gemm_tactics(16, 768, 3072)
    assert any(t["SPLIT_K"] > 1 for t in small) and all(t["BLOCK_M"] <= 32 for t in small)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,nn", [(8192, 768, 3072), (8192, 3072, 768), (16, 768, 2304)])
def test_triton_gemm_gpu_bert_shapes(m, k, nn):
    x, w = randn(m, k, dtype=torch.float16, device="cuda"), randn(k, nn, dtype=torch.float16,
                                                                   device="cuda") / k ** 0.5
    b = randn(nn, dtype=torch.float16, device="cuda")
    n = call(FC.FusedMatMul, activation="Gelu")
    want = F.gelu(x.float() @ w.float() + b.float())
    for t in [None, *G._matmul_tactics(n, (x, w, b))]:
        n.tactic = t
        assert_close(G.fused_matmul(n, x, w, b), want, scale=3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["Relu", "GeluTanh", "Gelu"])
def test_triton_gemm_gpu_library_epilogues(act):
    """cuBLASLt's fused epilogue and the flat Triton pass at BERT's FC1 shape (8192 x 3072:
    rows not a power of two wide)."""
    m, k, nn = 8192, 768, 3072
    x, w = randn(m, k, dtype=torch.float16, device="cuda"), randn(k, nn, dtype=torch.float16,
                                                                   device="cuda") / k ** 0.5
    b = randn(nn, dtype=torch.float16, device="cuda")
    n = call(FC.FusedMatMul, activation=act)
    want = ACT[act](x.float() @ w.float() + b.float())
    space = [t for t in G._matmul_tactics(n, (x, w, b)) if "impl" in t]
    assert any(t.get("flat") for t in space)
    assert any(t["impl"] == "cublaslt" for t in space) == (act != "Gelu")
    for t in space:
        n.tactic = t
        assert_close(G.fused_matmul(n, x, w, b), want, scale=3)


def test_triton_gemm_best_tiles_keeps_the_wave_model_best():
    tiles = [dict(zip(G.KEYS, c)) for c in G._CONFIGS]
    kept = G.best_tiles(tiles, 1, 1000, keep=3)
    assert len(kept) == 3 and all(t["BLOCK_M"] <= 64 for t in kept)  # m = 1: little padding
    assert any(t["BLOCK_M"] == 16 for t in kept)
    assert G.best_tiles(tiles[:2], 1, 1000, keep=3) == tiles[:2]  # nothing to drop
    big = G.best_tiles(tiles, 8192, 768, keep=4)
    assert all(t["BLOCK_M"] >= 128 for t in big)  # many tiles: the big ones, in full waves
    assert len(G.gemm_tactics(8192, 768, 3072)) <= G.TILE_KEEP


LN_CASES = [({"impl": "cublas", "LN_WARPS": 1}, ""), ({"impl": "cublas", "LN_WARPS": 4}, ""),
            (dict(SMALL, LN_WARPS=1), ""), (dict(SMALL, LN_WARPS=1), "Gelu"),
            ({"impl": "cublas", "LN_WARPS": 2, "LN_ROWS": 4}, "")]  # 4 rows a norm program


@pytest.mark.parametrize("tactic,act", LN_CASES)
@pytest.mark.parametrize("with_res", [False, True])
def test_triton_fused_matmul_layernorm(tactic, act, with_res):
    """LayerNorm(act(x @ w + b + r)): cuBLAS with the residual added by the norm kernel, or the
    Triton tile with its epilogue and the norm in place, against the written-out block."""
    x, w = randn(2, 5, 40, dtype=torch.float16), randn(40, 24, dtype=torch.float16)
    b, r = randn(24, dtype=torch.float16), randn(2, 5, 24, dtype=torch.float16)
    scale, ln_b = randn(24, dtype=torch.float16), randn(24, dtype=torch.float16)
    r = r if with_res else None
    n = call(FC.FusedMatMulLayerNorm, tactic, activation=act, has_residual=int(with_res),
             epsilon=1e-5)
    assert G._mm_ln_supports(n, (x, w, b, r, scale, ln_b))
    y = G.fused_matmul_layernorm(n, x, w, b, r, scale, ln_b)
    pre = x.float() @ w.float() + b.float() + (0 if r is None else r.float())
    want = F.layer_norm(ACT[act](pre), (24,), scale.float(), ln_b.float(), 1e-5)
    assert y.dtype == torch.float16 and y.shape == (2, 5, 24)
    assert_close(y, want, scale=3)


@pytest.mark.parametrize("act", ["", "Relu"])
def test_triton_fused_matmul_layernorm_residual_goes_to_the_norm(act, monkeypatch):
    """The Triton tile path: with no activation the norm adds the residual (the tile's
    epilogue takes only the bias); with one, the residual is added before it, in the tile.
    A residual that is not contiguous (a transposed view) is read correctly either way."""
    x, w = randn(2, 5, 40, dtype=torch.float16), randn(40, 24, dtype=torch.float16)
    b, scale, ln_b = (randn(24, dtype=torch.float16) for _ in range(3))
    r = randn(2, 24, 5, dtype=torch.float16).transpose(1, 2)  # [2, 5, 24], not contiguous
    seen = {}
    real_gemm, real_norm = G.gemm2d, G.norm_rows
    monkeypatch.setattr(G, "gemm2d", lambda n, a, bb, bias=None, res=None, *rest: (
        seen.__setitem__("gemm_res", res is not None) or real_gemm(n, a, bb, bias, res, *rest)))
    monkeypatch.setattr(G, "norm_rows", lambda *a, res=None, **k: (
        seen.__setitem__("norm_res", res is not None) or real_norm(*a, res=res, **k)))
    n = call(FC.FusedMatMulLayerNorm, dict(SMALL, LN_WARPS=1), activation=act, has_residual=1,
             epsilon=1e-5)
    y = G.fused_matmul_layernorm(n, x, w, b, r, scale, ln_b)
    assert seen == {"gemm_res": bool(act), "norm_res": not act}
    pre = ACT[act](x.float() @ w.float() + b.float() + r.float())
    assert_close(y, F.layer_norm(pre, (24,), scale.float(), ln_b.float(), 1e-5), scale=3)


def test_triton_fused_matmul_layernorm_tactics():
    """cuBLAS tactics only where no activation sits between the product and the norm; the
    Triton tiles always (library-free, for a fast first run); rows past 8192 run PyTorch's."""
    x, w, s = randn(4, 32, dtype=torch.float16), randn(32, 16, dtype=torch.float16), \
        randn(16, dtype=torch.float16)
    plain = G._mm_ln_tactics(call(FC.FusedMatMulLayerNorm), (x, w, None, None, s))
    gelu = G._mm_ln_tactics(call(FC.FusedMatMulLayerNorm, activation="Gelu"),
                            (x, w, None, None, s))
    assert [t for t in plain if t.get("impl") == "cublas"]
    assert not [t for t in gelu if t.get("impl") == "cublas"] and gelu
    many = randn(8192, 32, dtype=torch.float16)  # BERT-base b64's rows: multi-row norms too
    rows = [t for t in G._mm_ln_tactics(call(FC.FusedMatMulLayerNorm), (many, w, None, None, s))
            if t.get("LN_ROWS")]
    assert rows and all(t["impl"] == "cublas" for t in rows)
    assert not [t for t in plain if t.get("LN_ROWS")]  # 4 rows: one a program
    wide = randn(32, 8200, dtype=torch.float16)
    assert not G._mm_ln_supports(call(FC.FusedMatMulLayerNorm),
                                 (x, wide, None, None, randn(8200, dtype=torch.float16)))
