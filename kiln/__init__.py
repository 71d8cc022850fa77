"""kiln: an inference optimizer and runtime for ONNX models."""

__version__ = "0.1.0"
