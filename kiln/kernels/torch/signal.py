"""PyTorch kernels: signal ops."""

from kiln.kernels.registry import register  # noqa: F401
