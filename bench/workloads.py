"""The workloads: which zoo model, at which batch and sequence length, with which options.

all-MiniLM-L6-v2's real weights come from a pip package; where it is not installed (the GPU
machine) the minilm workload runs the same architecture with random weights, and says so in its
name. ``--models minilm-random`` asks for the random weights everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kiln.zoo import build_onnx, minilm, sample_inputs
from kiln.zoo.export import MODELS

LABELS = {"resnet50": "ResNet-50", "bert-base": "BERT-base", "minilm": "all-MiniLM-L6-v2",
          "gpt2": "GPT-2 small"}
DEFAULT_MODELS = ("resnet50", "bert-base", "minilm", "gpt2")
QUICK_MODELS = ("bert-base",)
SEQ = 128
QUICK_SEQ = 16
# The large batch per device (batch 1 is always run).
LARGE_BATCH = {
    "cpu": {"resnet50": 8, "bert-base": 8, "minilm": 8, "gpt2": 8},
    "cuda": {"resnet50": 256, "bert-base": 64, "minilm": 8, "gpt2": 8},
}
# --quick: tiny variants through the zoo's build options (minilm and resnet50 have none that
# shrink them, so they stay full size).
TINY_OPTS = {
    "bert-base": {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128, "vocab": 1000},
    "gpt2": {"layers": 1, "hidden": 64, "heads": 2, "vocab": 1000},
}

RANDOM = {"weights": "random"}
# --models names that are a zoo model with fixed options.
VARIANTS = {"minilm-random": ("minilm", RANDOM)}
# Models whose real weights need a package: without it they run with random weights.
HAS_REAL_WEIGHTS = {"minilm": minilm.has_package}


@dataclass(frozen=True)
class Workload:
    model: str
    batch: int
    seq: int
    opts: tuple[tuple[str, object], ...] = ()

    @property
    def options(self) -> dict:
        return dict(self.opts)

    @property
    def name(self) -> str:
        label = LABELS.get(self.model, self.model)
        opts = self.options
        if opts.pop("weights", "real") == "random":
            label += " (random weights)"
        if opts:
            label += " (tiny)"
        if self.model != "resnet50":
            label += f" s{self.seq}"
        return label

    @property
    def key(self) -> str:
        return f"{self.model}{''.join(f'-{k}{v}' for k, v in self.opts)}-s{self.seq}-b{self.batch}"

    def onnx_path(self):
        return build_onnx(self.model, **self.options)

    @cached_property
    def feeds(self) -> dict[str, np.ndarray]:
        """The inputs every system gets (seed 0)."""
        return sample_inputs(self.model, self.batch, self.seq, **self.options)

    @property
    def zoo_module(self):
        return MODELS[self.model].module


def workloads(device: str, models=None, batches=None, quick: bool = False) -> list[Workload]:
    """Workloads in run order: model by model, batches ascending."""
    models = list(models or (QUICK_MODELS if quick else DEFAULT_MODELS))
    out = []
    for name in models:
        m, opts = VARIANTS.get(name, (name, {}))
        if m not in MODELS:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join([*MODELS, *VARIANTS])}")
        bs = batches or ((1,) if quick else (1, LARGE_BATCH[device][m]))
        opts = {**opts, **(TINY_OPTS.get(m, {}) if quick else {})}
        if m in HAS_REAL_WEIGHTS and not HAS_REAL_WEIGHTS[m]():
            opts.update(RANDOM)
        seq = QUICK_SEQ if quick else SEQ
        out += [Workload(m, b, seq, tuple(sorted(opts.items()))) for b in sorted(set(bs))]
    return out
