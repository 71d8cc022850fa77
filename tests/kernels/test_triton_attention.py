import math

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.triton import attention as A
from kiln.ops import fused_transformer as FT
from tests.kernels.triton_util import assert_close, call, dot_dtypes, gpu, randn

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}


def _ref(q, k, v, mask, causal, scale):
    """[B, H, S, D] attention in fp32, written out (no SDPA)."""
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask.float()
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v.float()


def _heads(x, h):
    return x.unflatten(-1, (h, -1)).transpose(1, 2)


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("dtype", dot_dtypes(torch.float16, torch.bfloat16))
def test_triton_attention_packed_heads(causal, with_mask, dtype):
    b, h, sq, sk, d, dv = 2, 2, 20, 23, 16, 24
    q, k, v = randn(b, sq, h * d, dtype=dtype), randn(b, sk, h * d, dtype=dtype), \
        randn(b, sk, h * dv, dtype=dtype)
    mask = randn(b, 1, 1, sk, dtype=dtype) if with_mask else None
    n = call(FT.Attention, SMALL, num_heads=h, scale=0.3, causal=causal)
    assert A.supports(n, (q, k, v, mask))
    y = A.attention(n, q, k, v, mask)
    want = _ref(_heads(q, h), _heads(k, h), _heads(v, h), mask, causal, 0.3)
    assert y.dtype == dtype and y.shape == (b, sq, h * dv)
    assert_close(y, want.transpose(1, 2).flatten(-2), scale=2)


def test_triton_attention_k_transposed_and_2d_mask():
    q, kt, v = randn(2, 3, 17, 16, dtype=torch.float16), randn(2, 3, 16, 17,
                                                               dtype=torch.float16), \
        randn(2, 3, 17, 16, dtype=torch.float16)
    mask = randn(17, 17, dtype=torch.float16)
    n = call(FT.Attention, SMALL, num_heads=0, scale=0.25, causal=1)
    y = A.attention(n, q, kt, v, mask)
    assert_close(y, _ref(q, kt.transpose(-1, -2), v, mask, True, 0.25), scale=2)


def test_triton_attention_default_tactic_3d():
    q, kt, v = randn(3, 10, 32, dtype=torch.float16), randn(3, 32, 12, dtype=torch.float16), \
        randn(3, 12, 32, dtype=torch.float16)
    y = A.attention(call(FT.Attention, num_heads=0, scale=1 / math.sqrt(32)), q, kt, v)
    assert y.shape == (3, 10, 32)
    assert_close(y, _ref(q, kt.transpose(-1, -2), v, None, False, 1 / math.sqrt(32)))


def test_triton_attention_falls_back_for_fp32_and_integer_masks():
    q, k, v = randn(1, 4, 16), randn(1, 4, 16), randn(1, 4, 16)
    n = call(FT.Attention, num_heads=2, scale=0.5)
    assert not A.supports(n, (q, k, v, None))
    y = A.attention(n, q, k, v)
    want = _ref(_heads(q, 2), _heads(k, 2), _heads(v, 2), None, False, 0.5)
    torch.testing.assert_close(y, want.transpose(1, 2).flatten(-2), atol=1e-5, rtol=1e-5)
    h = q.half()
    mask = torch.ones(1, 1, 4, 4, dtype=torch.uint8, device=q.device)
    assert not A.supports(n, (h, h, h, mask))


@pytest.mark.parametrize("expanded", [False, True], ids=["keys", "full"])
@pytest.mark.parametrize("causal", [0, 1])
def test_triton_attention_bool_key_padding_mask(causal, expanded, monkeypatch):
    """A boolean mask (True: attend), as HF's SDPA exports build it from attention_mask: the
    padded keys of each sequence get no weight; same result as the additive -inf form. At
    [B, 1, 1, Sk] (the same for every query) it is read as one row of keys a block
    (MASK_KEYS); materialized [B, 1, Sq, Sk], tile by tile."""
    b, h, s, d = 3, 2, 19, 16
    q, k, v = (randn(b, s, h * d, dtype=torch.float16) for _ in range(3))
    lengths = torch.tensor([19, 11, 1])
    keep = (torch.arange(s)[None, :] < lengths[:, None]).reshape(b, 1, 1, s).to(q.device)
    if expanded:
        keep = keep.expand(b, 1, s, s).contiguous()
    seen = []
    real = A.launch
    monkeypatch.setattr(A, "launch", lambda *a, **kw: seen.append(kw["MASK_KEYS"]) or
                        real(*a, **kw))
    n = call(FT.Attention, SMALL, num_heads=h, scale=0.25, causal=causal)
    assert A.supports(n, (q, k, v, keep))
    y = A.attention(n, q, k, v, keep)
    additive = torch.zeros(keep.shape, device=q.device).masked_fill(~keep, float("-inf"))
    want = _ref(_heads(q, h), _heads(k, h), _heads(v, h), additive, causal, 0.25)
    assert_close(y, want.transpose(1, 2).flatten(-2), scale=2)
    assert seen == [not expanded]


@pytest.mark.parametrize("bool_mask", [False, True])
def test_triton_attention_fully_masked_row_is_zeros(bool_mask):
    """A sequence whose keys are all masked (attention_mask all 0): zeros, as SDPA and the
    safe-softmax guard HF exports give (the fusion drops that guard), not 0/0."""
    b, h, s, d = 2, 2, 9, 16
    q, k, v = (randn(b, s, h * d, dtype=torch.float16) for _ in range(3))
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
    keep[1] = False
    mask = keep if bool_mask else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    mask = mask.to(q.device)
    n = call(FT.Attention, SMALL, num_heads=h, scale=0.25)
    y = A.attention(n, q, k, v, mask.half() if not bool_mask else mask)
    assert torch.isfinite(y.float()).all() and not y[1].float().abs().any()
    want = _ref(_heads(q[:1], h), _heads(k[:1], h), _heads(v[:1], h), None, 0, 0.25)
    assert_close(y[:1], want.transpose(1, 2).flatten(-2), scale=2)


def test_triton_attention_merged_qkv_views():
    """qkv_split: input 0 is the merged projection [B, S, Dq + Dk + Dv]; q, k, v are read as
    strided views of it (no copy), inputs 1 and 2 absent."""
    b, h, s, d = 2, 2, 13, 16
    qkv = randn(b, s, 3 * h * d, dtype=torch.float16)
    mask = randn(b, 1, 1, s, dtype=torch.float16)
    n = call(FT.Attention, SMALL, num_heads=h, scale=0.25, qkv_split=[h * d] * 3)
    assert A.supports(n, (qkv, None, None, mask))
    y = A.attention(n, qkv, None, None, mask)
    q, k, v = qkv.split([h * d] * 3, dim=-1)
    want = _ref(_heads(q, h), _heads(k, h), _heads(v, h), mask, False, 0.25)
    assert y.shape == (b, s, h * d)
    assert_close(y, want.transpose(1, 2).flatten(-2), scale=2)
    assert A.tactics(n, (qkv, None, None, mask))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("bool_mask", [False, True])
def test_triton_attention_gpu_bert_shape(causal, bool_mask):
    b, h, s, d = 64, 12, 128, 64
    q, k, v = (randn(b, s, h * d, dtype=torch.float16, device="cuda") for _ in range(3))
    mask = randn(b, 1, 1, s, dtype=torch.float16, device="cuda")
    if bool_mask:  # key padding: the second half of every other sequence
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
        mask[::2, ..., s // 2:] = False
    n = call(FT.Attention, num_heads=h, scale=d ** -0.5, causal=causal)
    add = (torch.zeros(mask.shape, device="cuda").masked_fill(~mask, float("-inf"))
           if bool_mask else mask)
    want = _ref(_heads(q, h), _heads(k, h), _heads(v, h), add, causal, d ** -0.5)
    want = want.transpose(1, 2).flatten(-2)
    for t in [None, *A.tactics(n, (q, k, v, mask))]:
        n.tactic = t
        assert_close(A.attention(n, q, k, v, mask), want, scale=2)
