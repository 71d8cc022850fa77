"""PyTorch kernels: attention ops."""

from kiln.kernels.registry import register  # noqa: F401
