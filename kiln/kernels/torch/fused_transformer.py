"""PyTorch kernels for fused ops (fused_transformer)."""

from kiln.kernels.registry import register  # noqa: F401
