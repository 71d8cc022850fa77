"""The corpus manifest: one JSON file beside the ONNX files, one entry per model.

    {"version": 1, "models": {"<name>": {
        "name": ..., "file": "<name>.onnx", "family": "cnn", "source": "torchvision resnet50",
        "exporter": "torchscript" | "dynamo" | "shipped" | "onnxruntime.quantization",
        "opset": 17, "has_torch_definition": true, "batch_dynamic": true,
        "inputs": [{"name": "x", "shape": [1, 3, 224, 224], "dtype": "float32",
                    "low": null, "high": null, "value": null,
                    "onnx_shape": ["batch", 3, 224, 224]}],
        "outputs": ["logits"], "bytes": 102000000, "sha256": "..."}}}

``shape`` is the shape the bench feeds (batch 1); ``onnx_shape`` is what the file declares
(a name for a symbolic dim, -1 where an exporter wrote it so). Feeds are seeded: floats are
standard normal, integers uniform in ``[low, high)``, and an input with ``value`` is filled with it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1
DEFAULT_DIR = Path(os.path.expanduser("~/.cache/kiln/corpus"))
MANIFEST = "manifest.json"
DTYPES = ("float32", "float16", "int64", "int32", "bool", "uint8")


@dataclass
class InputSpec:
    name: str
    shape: list[int]
    dtype: str = "float32"
    low: int | None = None  # integers: uniform in [low, high)
    high: int | None = None
    value: float | None = None  # every element this value (a flag, a sample rate)
    onnx_shape: list | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"input {self.name!r}: dtype {self.dtype!r} is not one of {DTYPES}")
        if self.dtype in ("int64", "int32") and self.value is None and (
                self.low is None or self.high is None or self.high <= self.low):
            raise ValueError(f"input {self.name!r}: an integer input needs low < high "
                             f"(got {self.low}, {self.high}) or a value")

    def sample(self, rng: np.random.Generator, batch: int | None = None) -> np.ndarray:
        shape = list(self.shape)
        if batch is not None and shape:
            shape[0] = batch
        if self.value is not None:
            return np.full(shape, self.value, dtype=self.dtype)
        if self.dtype in ("int64", "int32", "uint8"):
            return rng.integers(self.low or 0, self.high or 256, size=shape).astype(self.dtype)
        if self.dtype == "bool":
            return rng.random(shape) < 0.5
        return rng.standard_normal(shape).astype(self.dtype)


@dataclass
class Entry:
    name: str
    family: str
    source: str
    exporter: str
    opset: int | None
    inputs: list[InputSpec]
    has_torch_definition: bool = False
    batch_dynamic: bool = False
    outputs: list[str] = field(default_factory=list)
    file: str = ""
    bytes: int = 0
    sha256: str = ""
    note: str = ""

    def __post_init__(self):
        self.inputs = [i if isinstance(i, InputSpec) else InputSpec(**i) for i in self.inputs]
        self.file = self.file or f"{self.name}.onnx"

    def feeds(self, seed: int = 0, batch: int | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {i.name: i.sample(rng, batch if self.batch_dynamic else None)
                for i in self.inputs}

    def to_json(self) -> dict:
        return asdict(self)


def load(directory: Path | str = DEFAULT_DIR) -> dict[str, Entry]:
    """The manifest's entries by name; a missing or malformed manifest is a clear error."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(
            f"no corpus manifest at {path}: build the corpus first with "
            f"`python -m bench.corpus.export --out {directory}`")
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')!r}, this code reads {VERSION}")
        return {name: Entry(**e) for name, e in data["models"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"corpus manifest {path} is malformed ({exc}); rebuild it with "
                         f"`python -m bench.corpus.export --out {directory}`") from exc


def save(entries: dict[str, Entry], directory: Path | str) -> Path:
    path = Path(directory) / MANIFEST
    data = {"version": VERSION, "models": {n: e.to_json() for n, e in sorted(entries.items())}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)  # never a half-written manifest
    return path


def update(entry: Entry, directory: Path | str) -> Path:
    """Add or replace one entry, keeping the others (several exports share one manifest)."""
    try:
        entries = load(directory)
    except FileNotFoundError:
        entries = {}
    entries[entry.name] = entry
    return save(entries, directory)
