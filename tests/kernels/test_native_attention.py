"""kiln's native attention and LayerNorm (attention.c, layernorm.c) on both sides of their
serial-work thresholds: a decoder step's one-query attention and a few rows of norm run on
the caller's thread, larger ones on the team, and both agree with PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason="kiln's C library is not built")


def _threads(n):
    class Threads:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)
    return Threads()


@pytest.mark.parametrize("b,h,hkv,sq,skv,d", [
    (1, 4, 4, 1, 33, 32),    # a Llama decode step: 4 * 33 * 64 multiply-adds, serial
    (1, 4, 2, 1, 17, 64),    # grouped-query decode step, serial
    (2, 4, 4, 64, 64, 32),   # a prompt: 2 * 4 * 64 * 64 * 64 multiply-adds, on the team
])
def test_attention_matches_torch_serial_and_parallel(b, h, hkv, sq, skv, d):
    torch.manual_seed(0)
    q = torch.randn(b, h, sq, d)
    k, v = torch.randn(b, hkv, skv, d), torch.randn(b, hkv, skv, d)
    mask = torch.zeros(b, 1, sq, skv)
    mask[..., 0] = float("-inf")  # the first key masked
    small = b * h * sq * skv * 2 * d < 64 * 64 * 64
    assert small == (sq == 1)
    with _threads(2):
        out = native.attention(q, k, v, mask, d ** -0.5, -1, torch.empty(b, h, sq, d))
    rep = h // hkv
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                          v.repeat_interleave(rep, 1), attn_mask=mask)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 256), (8, 256), (512, 256)])
def test_layer_norm_matches_torch_serial_and_parallel(rows, n):
    torch.manual_seed(1)
    x = torch.randn(rows, n) * 3 + 1
    g, bias = torch.randn(n), torch.randn(n)
    want = F.layer_norm(x, (n,), g, bias, 1e-5)
    with _threads(2):
        got = native.layer_norm_(x.clone(), g, bias, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
