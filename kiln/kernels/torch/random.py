"""PyTorch kernels: random ops."""

from kiln.kernels.registry import register  # noqa: F401
