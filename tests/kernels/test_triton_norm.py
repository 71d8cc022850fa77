import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.triton import norm
from kiln.ops import nn as N
from tests.kernels.triton_util import assert_close, call, gpu, randn

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (x shape, axis, tactic): one block per row, and a row longer than BLOCK (the looped path)
CASES = [((3, 4, 10), -1, None), ((2, 3, 50), -1, {"BLOCK": 16, "num_warps": 1}),
         ((2, 3, 4, 5), 2, None)]


def _ln_ref(x, w, b, axis, eps=1e-5):
    shape = x.shape[axis % x.dim():]
    return F.layer_norm(x.float(), shape, w.float(), None if b is None else b.float(), eps)


def _rms_ref(x, w, axis, eps=1e-5):
    dims = tuple(range(axis % x.dim(), x.dim()))
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis,tactic", CASES)
def test_triton_layernorm_matches_torch(dtype, shape, axis, tactic):
    x = randn(*shape, dtype=dtype)
    w, b = randn(*shape[axis:], dtype=dtype), randn(*shape[axis:], dtype=dtype)
    n = call(N.LayerNormalization, tactic, axis=axis)
    assert norm.supports(n, (x, w, b))
    y = norm.layer_norm(n, x, w, b)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, _ln_ref(x, w, b, axis))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis,tactic", CASES)
def test_triton_rmsnorm_matches_torch(dtype, shape, axis, tactic):
    x = randn(*shape, dtype=dtype)
    w = randn(*shape[axis:], dtype=dtype)
    n = call(N.RMSNormalization, tactic, axis=axis, epsilon=1e-6)
    y = norm.rms_norm(n, x, w)
    assert y.dtype == dtype
    assert_close(y, _rms_ref(x, w, axis, 1e-6))


def test_triton_layernorm_no_bias():
    x, w = randn(4, 24), randn(24)
    y = norm.layer_norm(call(N.LayerNormalization), x, w)
    assert_close(y, _ln_ref(x, w, None, -1))


def test_triton_layernorm_falls_back_for_stats_outputs():
    # Mean/InvStdDev outputs are not produced by the Triton kernel: the torch kernel runs
    x, w = randn(2, 8), randn(8)
    n = call(N.LayerNormalization, n_out=3)
    assert not norm.supports(n, (x, w, None))
    y, mean, inv = norm.layer_norm(n, x, w)
    assert_close(y, _ln_ref(x, w, None, -1))
    assert mean.shape == (2, 1)


def test_triton_norm_tactic_space_covers_row():
    x, w = randn(2, 300), randn(300)
    space = norm.tactics(call(N.LayerNormalization), (x, w))
    assert {"BLOCK": 512, "num_warps": 4} in space
    assert all(t["BLOCK"] <= 512 for t in space)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_triton_layernorm_gpu_bert_shape(dtype):
    x = randn(64 * 128, 768, dtype=dtype, device="cuda")
    w, b = randn(768, dtype=dtype, device="cuda"), randn(768, dtype=dtype, device="cuda")
    n = call(N.LayerNormalization)
    for t in [None, *norm.tactics(n, (x, w, b))]:
        n.tactic = t
        assert_close(norm.layer_norm(n, x, w, b), _ln_ref(x, w, b, -1), scale=2)
    assert_close(norm.rms_norm(call(N.RMSNormalization), x, w), _rms_ref(x, w, -1), scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_res", [False, True])
def test_triton_norm_row_tile_matches_torch(dtype, rms, with_res):
    """ROWS rows a program: 37 rows of 24 (a partial last tile, padded columns), plus the
    residual the norm adds as it reads; in place like the fused product's use."""
    x, r = randn(37, 24, dtype=dtype), randn(37, 24, dtype=dtype)
    w, b = randn(24, dtype=dtype), randn(24, dtype=dtype)
    pre = x.float() + (r.float() if with_res else 0)
    want = _rms_ref(pre, w, -1) if rms else _ln_ref(pre, w, b, -1)
    y = norm.norm_rows(x, w, None if rms else b, 24, 1e-5, rms, 32, 2,
                       res=r if with_res else None, out=x, rows=4)
    assert y is x
    assert_close(y, want)


def test_triton_norm_row_tiles_only_for_short_rows_and_many_of_them():
    """Multi-row tactics where a row fits TILE_COLS and there are ROWS rows per SM at least
    (BERT-base b64: 8192 rows of 768, padded 1024); none for 8 rows or 4096-wide rows. The
    op's kernel takes them, and runs them."""
    tiles = norm.row_tiles(1024, 8192)
    assert tiles and all(t["BLOCK"] == 1024 and t["ROWS"] > 1 for t in tiles)
    assert norm.row_tiles(1024, 8) == [] and norm.row_tiles(4096, 8192) == []
    assert all(t["ROWS"] * norm.SMS <= 600 for t in norm.row_tiles(32, 600))
    x, w, b = randn(600, 24), randn(24), randn(24)
    n = call(N.LayerNormalization)
    space = norm.row_tactics(n, (x, w, b))
    assert norm.tactics(n, (x, w, b)) == [t for t in space if "ROWS" not in t]
    tile = [t for t in space if t.get("ROWS")][0]
    y = norm.layer_norm(call(N.LayerNormalization, tile), x, w, b)
    assert_close(y, _ln_ref(x, w, b, -1))
