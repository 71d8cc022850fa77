"""PyTorch kernels: reduce ops."""

from kiln.kernels.registry import register  # noqa: F401
