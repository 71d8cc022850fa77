"""ONNX -> kiln Graph."""

from kiln.frontend.convert import import_onnx
from kiln.frontend.loader import load_model

__all__ = ["import_onnx", "load_model"]
