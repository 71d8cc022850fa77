"""attention ops."""

from kiln.ops.schema import onnx_op  # noqa: F401
