"""Quantization: calibration (data, calibrators, TensorRT-format cache), the INT8 rewrite of an
optimized graph, and explicit quantization (QDQ models in and out)."""
