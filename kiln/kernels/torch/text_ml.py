"""PyTorch kernels: text_ml ops."""

from kiln.kernels.registry import register  # noqa: F401
