"""Real exports for the fusion tests: Hugging Face and torch modules built from tiny seeded
configs and exported by torch.onnx in the test run (nothing is downloaded)."""

from __future__ import annotations

import functools
import io

import numpy as np
import onnx
import pytest


def _export(module, args, names, outputs, axes=None, opset=17,
            dynamo=False) -> onnx.ModelProto:
    import torch

    if dynamo:  # the torch.export-based exporter (static shapes here), through onnxscript
        pytest.importorskip("onnxscript")
        with torch.no_grad():
            prog = torch.onnx.export(module.eval(), args, input_names=names,
                                     output_names=outputs, opset_version=opset, dynamo=True,
                                     verbose=False)
        return prog.model_proto
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module.eval(), args, buf, input_names=names, output_names=outputs,
                          dynamic_axes=axes, opset_version=opset, dynamo=False)
    return onnx.load_from_string(buf.getvalue())


@functools.cache
def hf_bert(attn: str = "sdpa", layers: int = 2, probs_out: bool = False,
            dynamo: bool = False) -> bytes:
    """transformers BertModel (hidden 32, 2 heads, seq 8; dynamic batch and seq with the
    TorchScript exporter, static [2, 8] with dynamo at opset 18), as bytes."""
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

    ids = torch.randint(0, 50, (2 if dynamo else 1, 8))
    outs = ["y"] + [f"probs{i}" for i in range(layers if probs_out else 0)]
    axes = None if dynamo else {"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}}
    return _export(Wrapped(), (ids, torch.ones_like(ids)), ["ids", "mask"], outs, axes,
                   18 if dynamo else 17, dynamo).SerializeToString()


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


def _same_pad_net():
    """A small mobile CNN with TensorFlow "same" padding computed from the input's size at run
    time (as timm's ``tf_`` models and TF converters write it): Shape -> Gather -> arithmetic
    -> Concat -> Pad before each conv, depthwise convs, squeeze-excite, HardSwish."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class SameConv(nn.Conv2d):
        def forward(self, x):
            k, s = self.kernel_size[0], self.stride[0]
            ih, iw = x.shape[2], x.shape[3]
            ph = torch.clamp((torch.div(ih + s - 1, s, rounding_mode="floor") - 1) * s + k - ih,
                             min=0)
            pw = torch.clamp((torch.div(iw + s - 1, s, rounding_mode="floor") - 1) * s + k - iw,
                             min=0)
            x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
            return F.conv2d(x, self.weight, self.bias, self.stride, 0, 1, self.groups)

    class SE(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.reduce, self.expand = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

        def forward(self, x):
            s = x.mean((2, 3), keepdim=True)
            return x * F.hardsigmoid(self.expand(F.relu(self.reduce(s))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.bn = SameConv(3, 16, 3, 2, bias=False), nn.BatchNorm2d(16)
            self.dw, self.se = SameConv(16, 16, 3, 1, groups=16), SE(16)
            self.pw = nn.Conv2d(16, 24, 1)
            self.dw2 = SameConv(24, 24, 5, 2, groups=24)

        def forward(self, x):
            x = F.hardswish(self.bn(self.stem(x)))
            x = self.pw(self.se(F.relu6(self.dw(x))))
            return F.silu(self.dw2(x)).mean((2, 3))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net


@functools.cache
def same_pad_cnn() -> bytes:
    """:func:`_same_pad_net` exported with dynamic batch, height and width, as bytes."""
    import torch

    x = torch.randn(1, 3, 48, 64)
    axes = {"x": {0: "n", 2: "h", 3: "w"}}
    return _export(_same_pad_net(), (x,), ["x"], ["y"], axes).SerializeToString()


@functools.cache
def pad_then(kind: str) -> bytes:
    """F.pad then one op, exported with a static input [1, 4, 10, 12]: ``conv`` (zero pad),
    ``avgpool`` (zero pad, count_include_pad=False), ``reflect`` (reflect pad, conv),
    ``value`` (pad with 1.0, conv), ``maxpool`` (zero pad)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    conv, pads = nn.Conv2d(4, 6, 3), [1, 2, 0, 1]
    ops = {"conv": lambda x: conv(F.pad(x, pads)),
           "avgpool": lambda x: F.avg_pool2d(F.pad(x, pads), 3, 1, count_include_pad=False),
           "reflect": lambda x: conv(F.pad(x, pads, mode="reflect")),
           "value": lambda x: conv(F.pad(x, pads, value=1.0)),
           "maxpool": lambda x: F.max_pool2d(F.pad(x, pads), 3, 1)}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return ops[kind](x)

    return _export(Net(), (torch.randn(1, 4, 10, 12),), ["x"], ["y"]).SerializeToString()


def export_module(module, shape, opset: int = 17) -> onnx.ModelProto:
    """``module`` on one float input ``x`` of ``shape`` (dim 0 dynamic), exported."""
    import torch

    torch.manual_seed(0)
    return _export(module, (torch.randn(*shape),), ["x"], ["y"], {"x": {0: "b"}}, opset)


@functools.cache
def hf_gpt2(layers: int = 2) -> bytes:
    """transformers GPT2Model (hidden 32, 2 heads, tanh GELU "gelu_new", Conv1D layers: Gemm
    between Reshapes), no KV cache, dynamic batch and seq (TorchScript exporter, opset 17)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=2, vocab_size=50, n_positions=32,
                     use_cache=False)
    gpt = GPT2Model(cfg).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self, ids, mask):
            return self.gpt(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state

    ids = torch.randint(0, 50, (1, 8))
    axes = {"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}}
    return _export(Wrapped(), (ids, torch.ones_like(ids)), ["ids", "mask"], ["y"], axes,
                   17).SerializeToString()
