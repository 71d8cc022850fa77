"""kiln.zoo: reference models (ResNet-50, BERT-base, GPT-2, all-MiniLM-L6-v2) built from code.

    from kiln.zoo import build_onnx, sample_inputs
    path = build_onnx("bert-base", layers=2)     # cached .onnx file
    feeds = sample_inputs("bert-base", batch=2, seq=16)
"""

from kiln.zoo.export import build_onnx, cache_dir, cache_path, list_models, sample_inputs
from kiln.zoo.minilm import minilm_tokenize

__all__ = ["build_onnx", "cache_dir", "cache_path", "list_models", "minilm_tokenize",
           "sample_inputs"]
