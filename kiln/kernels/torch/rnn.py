"""PyTorch kernels: rnn ops."""

from kiln.kernels.registry import register  # noqa: F401
