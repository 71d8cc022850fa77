"""Triton INT8 GEMM (Int8MatMul on CUDA) against the exact integer reference; runs on a GPU or
under TRITON_INTERPRET=1 on small shapes."""

import numpy as np
import pytest
import torch

from tests.kernels.triton_util import DEVICE, INTERPRET

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from kiln.kernels.registry import Call
from kiln.kernels.triton import int8_gemm as T
from kiln.ops import int8 as I8
from kiln.passes.quantize.int8 import quantize_weight


def _reference(x, wq, ws, b, r, s, z, act):
    codes = np.clip(np.floor(x / s + 0.5) + z, 0, 255) - z
    y = (codes.astype(np.int64) @ wq.astype(np.int64)) * (s * ws)
    y = y + (0 if b is None else b) + (0 if r is None else r)
    return np.maximum(y, 0) if act == "Relu" else y


@pytest.mark.parametrize("m,k,n,zero,act,bias,res", [
    (16, 32, 16, 128, "", False, False),
    (20, 40, 24, 128, "Relu", True, False),  # ragged M, K, N
    (33, 64, 16, 61, "", True, True),  # asymmetric zero point, residual
])
def test_triton_int8_matmul(m, k, n, zero, act, bias, res):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wq, ws = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), 1)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((m, n)).astype(np.float32) if res else None
    s = float(np.abs(x).max() / 127)
    call = Call(I8.Int8MatMul.make_attrs(x_scale=s, x_zero=zero, activation=act,
                                         has_residual=int(res)), 1, 5,
                tactic=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2))

    def dev(a):
        return None if a is None else torch.from_numpy(a).to(DEVICE)

    got = T.triton_int8_matmul(call, dev(x), dev(wq), dev(ws), dev(b), dev(r))
    want = _reference(x, wq, ws, b, r, s, zero, act)
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
