"""PyTorch kernels: control ops."""

from kiln.kernels.registry import register  # noqa: F401
