"""Accuracy: runners (kiln engines, onnxruntime, the ONNX reference evaluator) and a comparator
that checks one against another output by output and layer by layer (``kiln compare``)."""

from kiln.compare.comparator import Metrics, compare_layers, compare_outputs, metrics
from kiln.compare.runners import KilnRunner, OnnxruntimeRunner, ReferenceRunner, make_runner

__all__ = ["Metrics", "compare_layers", "compare_outputs", "metrics", "KilnRunner",
           "OnnxruntimeRunner", "ReferenceRunner", "make_runner"]
