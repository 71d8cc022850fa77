"""PyTorch kernels: nn ops."""

from kiln.kernels.registry import register  # noqa: F401
