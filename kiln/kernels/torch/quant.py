"""PyTorch kernels: quant ops."""

from kiln.kernels.registry import register  # noqa: F401
