"""Real exports for the fusion tests: Hugging Face and torch modules built from tiny seeded
configs and exported by torch.onnx in the test run (nothing is downloaded)."""

from __future__ import annotations

import functools
import io

import numpy as np
import onnx
import pytest


def _export(module, args, names, outputs, axes=None, opset=17) -> onnx.ModelProto:
    import torch

    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module.eval(), args, buf, input_names=names, output_names=outputs,
                          dynamic_axes=axes, opset_version=opset, dynamo=False)
    return onnx.load_from_string(buf.getvalue())


@functools.lru_cache(maxsize=None)
def hf_bert(attn: str = "sdpa", layers: int = 2, probs_out: bool = False) -> bytes:
    """transformers BertModel (hidden 32, 2 heads, seq 8 dynamic), as bytes."""
    pytest.importorskip("transformers")
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(attn_implementation=attn, hidden_size=32, num_hidden_layers=layers,
                     num_attention_heads=2, intermediate_size=64, vocab_size=50,
                     max_position_embeddings=32)
    bert = BertModel(cfg).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            o = self.bert(input_ids=ids, attention_mask=mask, output_attentions=probs_out)
            return (o.last_hidden_state, *(o.attentions if probs_out else ()))

    ids = torch.randint(0, 50, (1, 8))
    outs = ["y"] + [f"probs{i}" for i in range(layers if probs_out else 0)]
    axes = {"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}}
    return _export(Wrapped(), (ids, torch.ones_like(ids)), ["ids", "mask"], outs,
                   axes).SerializeToString()


def bert_feeds(batch: int = 2, seq: int = 8) -> dict:
    rng = np.random.default_rng(1)
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - 3:] = 0  # padding in one row
    mask[1, :] = 0  # and one row fully masked: the safe softmax's zeros
    mask[1, 0] = 1
    return {"ids": rng.integers(0, 50, (batch, seq)), "mask": mask}


def ort_run(m: onnx.ModelProto | bytes, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    data = m if isinstance(m, bytes) else m.SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)
