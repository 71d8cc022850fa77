"""PyTorch kernels: vision ops."""

from kiln.kernels.registry import register  # noqa: F401
