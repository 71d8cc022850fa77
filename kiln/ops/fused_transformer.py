"""Fused ops kiln's optimizer creates (fused_transformer)."""

from kiln.ops.schema import kiln_op  # noqa: F401
