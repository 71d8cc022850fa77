"""Triton INT8 implicit-GEMM convolution (Int8Conv on CUDA) and its FP16 tactic against the
integer reference (dequantized codes, float32 conv); on a GPU or under TRITON_INTERPRET=1."""

import numpy as np
import pytest
import torch

from tests.kernels.triton_util import DEVICE, INTERPRET

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from kiln.kernels.registry import Call
from kiln.kernels.torch.int8 import _int8_conv_emulated
from kiln.kernels.triton import int8_conv as T
from kiln.ops import int8 as I8
from kiln.passes.quantize.int8 import quantize_weight

CL = torch.channels_last


def _codes(x, s, z):
    return (np.clip(np.floor(x / s + 0.5) + z, 0, 255) - 128).astype(np.int8)


@pytest.mark.parametrize("c,co,k,stride,pad,zero,x_codes,out_codes,res", [
    (16, 32, 3, 1, 1, 100, False, False, True),  # tap x channel-block walk, residual
    (3, 16, 7, 2, 3, 128, False, False, False),  # the stem: K walked flat
    (16, 16, 3, 1, 1, 90, True, False, False),  # codes in: padding is the code of 0.0
    (3, 16, 3, 2, 1, 70, True, True, False),  # flat walk with codes in and out
    (32, 16, 1, 2, 0, 128, False, True, True),  # 1x1 stride 2, codes out
])
def test_triton_int8_conv(c, co, k, stride, pad, zero, x_codes, out_codes, res):
    rng = np.random.default_rng(c * k + co)
    nb, h, w = 2, 9, 8
    x = rng.standard_normal((nb, c, h, w)).astype(np.float32)
    wq, ws = quantize_weight(rng.standard_normal((co, c, k, k)).astype(np.float32), 0)
    b = rng.standard_normal(co).astype(np.float32)
    s = float(np.abs(x).max() / 127)
    attrs = dict(x_scale=s, x_zero=zero, kernel_shape=[k, k], strides=[stride, stride],
                 pads=[pad] * 4, activation="Relu", out_float=1)
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    r = rng.standard_normal((nb, co, oh, ow)).astype(np.float32) if res else None

    def dev(a, cl=True):
        if a is None:
            return None
        t = torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)
        return t.contiguous(memory_format=CL) if cl and t.dim() == 4 else t

    ref_call = Call(I8.Int8Conv.make_attrs(**attrs), 1, 5)
    want = _int8_conv_emulated(ref_call, torch.from_numpy(x), torch.from_numpy(wq),
                               torch.from_numpy(ws), torch.from_numpy(b),
                               None if r is None else torch.from_numpy(r)).numpy()
    out_scale = float(want.max() / 255) if out_codes else 0.0
    call = Call(I8.Int8Conv.make_attrs(**attrs, out_scale=out_scale, out_zero=0), 1, 5,
                tactic=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=1,
                            num_stages=1))
    xin = dev(_codes(x, s, zero)) if x_codes else dev(x)
    ins = (xin, dev(wq, False), dev(ws), dev(b), dev(r))
    got = T.triton_int8_conv(call, *ins)
    assert got.shape == want.shape and got.is_contiguous(memory_format=CL)
    if out_codes:
        assert got.dtype == torch.int8
        wc = np.clip(np.floor(want / out_scale + 0.5), 0, 255) - 128
        d = np.abs(got.cpu().numpy().astype(np.int64) - wc)
        assert d.max() <= 1 and (d == 0).mean() > 0.97
    else:
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4,
                                   atol=1e-4 * np.abs(want).max())
    # the FP16 tactic: the same layer to FP16 rounding (a direct conv under the interpreter)
    x16 = xin if x_codes else xin.half()
    ins16 = (x16, ins[1], ins[2], ins[3].half(), None if r is None else ins[4].half())
    call16 = Call(I8.Int8Conv.make_attrs(**dict(attrs, out_float=10), out_scale=out_scale,
                                         out_zero=0), 1, 5)
    assert T._fp16_supports(call16, ins16)
    space = T._fp16_tactics(call16, ins16)
    call16.tactic = dict(space[-1])
    got16 = T.fp16_int8_conv(call16, *ins16)
    if out_codes:
        d = np.abs(got16.cpu().numpy().astype(np.int64) - got.cpu().numpy())
        assert d.max() <= 1
    else:
        np.testing.assert_allclose(got16.float().cpu().numpy(), want, rtol=1e-2,
                                   atol=3e-3 * np.abs(want).max())


def test_grouped_or_asymmetric_convs_are_not_taken():
    x = torch.zeros(1, 4, 6, 6, device=DEVICE)
    wq = torch.zeros(4, 2, 3, 3, dtype=torch.int8, device=DEVICE)
    ws = torch.ones(4, device=DEVICE)
    grouped = Call(I8.Int8Conv.make_attrs(x_scale=0.1, x_zero=128, kernel_shape=[3, 3],
                                          group=2, pads=[1] * 4), 1, 3)
    assert not T.supports(grouped, (x, wq, ws))
    asym = Call(I8.Int8Conv.make_attrs(x_scale=0.1, x_zero=128, kernel_shape=[3, 3],
                                       pads=[0, 0, 1, 1]), 1, 3)
    assert not T.supports(asym, (x, torch.zeros(4, 4, 3, 3, dtype=torch.int8), ws))
