"""PyTorch kernels for fused ops (fused_conv)."""

from kiln.kernels.registry import register  # noqa: F401
