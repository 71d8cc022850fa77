"""What the Triton kernel tests share: device, tolerances, a Call builder."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.kernels.registry import Call

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

# |got - want| <= atol + rtol * |want| against an fp32 reference, per input dtype
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 1e-2),
             torch.bfloat16: (1.6e-2, 5e-2)}

gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")


def call(op, tactic: dict | None = None, n_out: int = 1, **attrs) -> Call:
    return Call(op.make_attrs(**attrs), n_out, 4, tactic=tactic)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype=None, scale: float = 1.0):
    """``got`` (a kernel's output) against ``want`` (an fp32 reference), at the tolerance of
    ``dtype`` (default: got's dtype) times ``scale`` (for long reductions)."""
    atol, rtol = TOLERANCE[dtype or got.dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol * scale,
                               rtol=rtol * scale, equal_nan=True)


def randn(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)


def dot_dtypes(*dtypes):
    """pytest params for kernels using tl.dot: Triton 3.9's interpreter computes bf16 tl.dot
    wrong (numbers of 1e10 from N(0, 1) inputs), so bf16 runs there only on a GPU."""
    return [pytest.param(dt, marks=pytest.mark.skipif(
        INTERPRET and dt == torch.bfloat16, reason="interpreter: bf16 tl.dot is wrong"))
        for dt in dtypes]
