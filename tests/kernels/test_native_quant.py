"""kiln.native's DynamicQuantizeLinear (kiln/native/quant.c) against the torch steps it
replaces, bit for bit: scale, zero point and every code, on ties, one-sided and constant
tensors, odd sizes and sizes that take the threaded path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import quant_linear as QL
from kiln.ops import quant as Q

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")


def _torch_steps(x):
    """kiln's torch DynamicQuantizeLinear with the C kernel switched off."""
    hi, lo = torch.clamp(x.max(), min=0.0), torch.clamp(x.min(), max=0.0)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zp = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    return torch.clamp(torch.round(x / scale) + zp, 0.0, 255.0).to(torch.uint8), scale, \
        zp.to(torch.uint8)


def _cases():
    rng = np.random.default_rng(0)
    yield rng.standard_normal(1000 * 131 + 5).astype(np.float32)  # one thread, odd tail
    yield rng.standard_normal((1 << 20) + 13).astype(np.float32)  # threaded, odd tail
    yield np.abs(rng.standard_normal(37)).astype(np.float32) * 3  # one-sided: zero point 0
    yield -np.abs(rng.standard_normal(37)).astype(np.float32)  # zero point 255
    yield np.zeros(19, np.float32)  # constant: scale 1
    x = rng.standard_normal(4096).astype(np.float32)
    x[:2] = (-1.0, 254.0 / 255 * 2)  # a range whose codes fall on ties
    s = np.float32(np.float32(x.max() - x.min()) / np.float32(255))
    x[2:600] = ((np.arange(598) % 200 - 100) + 0.5).astype(np.float32) * s
    yield x


@needs_native
@pytest.mark.parametrize("k", range(5))
def test_native_dynamic_quantize_matches_torch_steps(k):
    x = torch.from_numpy(list(_cases())[k])
    got = native.dynamic_quantize(x)
    want = _torch_steps(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    kernel = QL.dynamic_quantize_linear(Call(Q.DynamicQuantizeLinear.make_attrs(), 1, 3), x)
    assert all(torch.equal(a, b) for a, b in zip(kernel, want))


@needs_native
def test_native_dynamic_quantize_refuses_strided():
    with pytest.raises(ValueError, match="contiguous float32"):
        native.dynamic_quantize(torch.zeros(4, 6).t())


@needs_native
@pytest.mark.parametrize("k", range(5))
def test_native_dynamic_qdq_is_the_codes_dequantized(k):
    x = torch.from_numpy(list(_cases())[k])
    y, s, z = native.dynamic_qdq(x)
    codes, scale, zp = _torch_steps(x)
    assert s == float(scale) and z == int(zp)
    assert torch.equal(y, (codes.float() - float(zp)) * scale)


@needs_native
def test_native_shifted_codes_and_requantize_match_torch_steps():
    """quant.c's static quantization (codes minus zero point) and QLinearMatMul
    requantization against the same float32 steps in torch, bit for bit, ties included."""
    rng = np.random.default_rng(2)
    s = np.float32(0.05)
    x = rng.standard_normal(1003).astype(np.float32) * 8
    x[:100] = (np.arange(100) - 50.5).astype(np.float32) * s  # ties
    xt = torch.from_numpy(x)
    want = torch.div(xt, float(s)).round_().add_(131).clamp_(0, 255).sub_(131)
    assert torch.equal(native.shifted_codes(xt, float(s), 131), want)
    acc = torch.from_numpy(rng.integers(-40000, 40000, (7, 37)).astype(np.float32))
    mult = torch.from_numpy((rng.random(37) * 4e-3).astype(np.float32))
    mult[0] = 1 / 64  # exact halves
    acc[:, 0] = torch.arange(7) * 64 + 32
    want = acc.mul(mult).round_().add_(-3).clamp_(-128, 127).sub_(-3).mul_(0.25)
    got = native.requantize_(acc.clone(), mult, 0.25, -3, -128, 127)
    assert torch.equal(got, want)
