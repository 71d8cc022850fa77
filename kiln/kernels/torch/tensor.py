"""PyTorch kernels: tensor ops."""

from kiln.kernels.registry import register  # noqa: F401
