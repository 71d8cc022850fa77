"""Non-saturating float8 casts run as torch ops (so on the device on a CUDA engine): checked
against ml_dtypes, the ONNX reference's own conversion, on values around every overflow edge."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.torch.convert import TORCH_DTYPE, to_numpy
from kiln.kernels.torch.quant import _F8_OVERFLOW, _np_cast, cast

EDGES = [np.inf, -np.inf, np.nan, 0.0, -0.0, 448, 464, 464.01, 480, 240, 247.9, 248, 57344,
         61439, 61440, 65536, -464.01, -248, -61440]


@pytest.mark.parametrize("to", sorted(_F8_OVERFLOW, key=str))
@pytest.mark.parametrize("src", [np.float32, np.float16])
def test_cast_float8_no_saturate_matches_ml_dtypes(to, src):
    rng = np.random.default_rng(0)
    v = rng.standard_normal(20000) * 10.0 ** rng.integers(-8, 6, 20000)
    with np.errstate(over="ignore"):
        x = torch.from_numpy(np.concatenate([v, EDGES]).astype(src))
    got = cast(x, to, saturate=False)
    assert isinstance(got, torch.Tensor) and got.dtype == TORCH_DTYPE[to]
    got = to_numpy(got).astype(np.float32)
    want = to_numpy(_np_cast(x, to, False, "up")).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN positions compare equal too
