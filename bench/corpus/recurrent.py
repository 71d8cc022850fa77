"""Small recurrent models from ``torch.nn``'s own LSTM and GRU (exported as ONNX LSTM/GRU)."""

from __future__ import annotations

from bench.corpus.manifest import InputSpec
from bench.corpus.spec import Spec, seeded


def _lstm():
    import torch

    class Tagger(torch.nn.Module):  # a 2-layer bidirectional LSTM tagger over features
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(64, 128, num_layers=2, batch_first=True,
                                      bidirectional=True)
            self.head = torch.nn.Linear(256, 32)

        def forward(self, x):
            return self.head(self.lstm(x)[0])

    return Tagger()


def _gru():
    import torch

    class Step(torch.nn.Module):  # a streaming GRU step: state in, state out
        def __init__(self):
            super().__init__()
            self.gru = torch.nn.GRU(40, 96, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(96, 1)

        def forward(self, x, h):
            y, h_next = self.gru(x, h)
            return torch.sigmoid(self.head(y[:, -1])), h_next

    return Step()


def specs() -> list[Spec]:
    return [
        Spec("torch_lstm_bidir_op13", "recurrent", "torch.nn.LSTM (2 layers, bidirectional)",
             "torchscript", [InputSpec("x", [1, 50, 64])], ["y"], 13, make=seeded(_lstm),
             dynamic={"x": {0: "batch", 1: "time"}}, requires=("torch",)),
        Spec("torch_gru_stream_op17", "recurrent", "torch.nn.GRU (2 layers, streaming step)",
             "torchscript", [InputSpec("x", [1, 8, 40]), InputSpec("h", [2, 1, 96])],
             ["p", "h_next"], 17, make=seeded(_gru), requires=("torch",)),
    ]
