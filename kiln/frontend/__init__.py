"""ONNX -> kiln Graph."""

from kiln.frontend.convert import import_onnx
from kiln.frontend.loader import load_model
from kiln.frontend.specialize import fixed_dims

__all__ = ["fixed_dims", "import_onnx", "load_model"]
