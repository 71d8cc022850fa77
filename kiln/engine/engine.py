"""Engine (immutable, shared between threads) and ExecutionContext (per-request state)."""

from __future__ import annotations

import os
import platform
import threading
from dataclasses import dataclass

import numpy as np
import torch

import kiln
from kiln.engine import format as fmt
from kiln.engine.executor import Executor
from kiln.engine.profile import Profile, check_feeds
from kiln.engine.serialize import PlanReader, PlanWriter, decode_type, encode_type
from kiln.errors import EngineFileError
from kiln.ir import DType, Graph, TensorType
from kiln.kernels.registry import kernels_for
from kiln.kernels.torch.convert import dtype_of, to_numpy, to_torch


@dataclass(frozen=True)
class TensorInfo:
    """An engine input or output: name, dtype and shape (ints, symbolic names, or None)."""

    name: str
    dtype: DType | None
    shape: tuple | None

    def shape_str(self) -> str:
        if self.shape is None:
            return "[*]"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"

    def to_json(self) -> dict:
        return {"name": self.name, "type": encode_type(TensorType(self.dtype, self.shape))}

    @classmethod
    def from_json(cls, d) -> TensorInfo:
        t = decode_type(d["type"])
        return cls(d["name"], t.dtype, t.shape)

    @classmethod
    def of(cls, v) -> TensorInfo:
        t = v.type if isinstance(v.type, TensorType) else TensorType(None, None)
        return cls(v.name, t.dtype, t.shape)


def device_info(kind: str) -> dict:
    if kind == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return {"kind": "cuda", "name": p.name, "capability": [p.major, p.minor]}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(),
            "capability": None}


class Engine:
    """A built model for one device. Immutable: share it between threads and create one
    :class:`ExecutionContext` per concurrent caller."""

    def __init__(self, graph: Graph, choices: dict[str, str], *, device: str = "cpu",
                 profiles: list[Profile] | None = None, build: dict | None = None,
                 header: dict | None = None):
        self.graph = graph
        self.choices = dict(choices)
        self.device = device
        self.profiles = list(profiles or [])
        self.build_info = dict(build or {})
        self.header = header or {}
        self.inputs = [TensorInfo.of(v) for v in graph.inputs]
        self.outputs = [TensorInfo.of(v) for v in graph.outputs]
        self._executor = Executor(graph, device, self._choose)

    def _choose(self, node, backend):
        ks = kernels_for(node.op, backend)
        want = self.choices.get(node.name)
        for k in ks:
            if want is None or k.name == want:
                return k
        raise EngineFileError(
            f"node '{node.name}' needs kernel {want!r} for {node.op.name}, which this kiln "
            "does not have; rebuild the engine with this kiln version")

    def create_context(self) -> ExecutionContext:
        return ExecutionContext(self)

    def layers(self) -> list[dict]:
        """One row per layer: name, op, precision, kernel, output shapes."""
        rows = []
        for n in self.graph.nodes:
            rows.append({"name": n.name, "op": n.op.name, "precision": _precision(n),
                         "kernel": self.choices.get(n.name, "?"),
                         "outputs": [str(v.type) for v in n.outputs]})
        return rows

    @property
    def weight_bytes(self) -> int:
        return int(sum(v.const.nbytes for v in self.graph.weights.values()
                       if v.const is not None and v.const.dtype != object))

    def save(self, path: str | os.PathLike) -> int:
        """Write the engine file atomically; returns its size in bytes."""
        w = PlanWriter()
        plan = w.graph(self.graph, self.choices)
        header = {
            "kiln_version": kiln.__version__, "torch_version": torch.__version__,
            "triton_version": _triton_version(), "device": device_info(self.device),
            "build": self.build_info, "profiles": [p.to_json() for p in self.profiles],
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": [o.to_json() for o in self.outputs],
            "layers": len(self.graph.nodes), "weight_bytes": self.weight_bytes, "plan": plan,
        }
        return fmt.write_engine(path, header, w.tensors)


def load(path: str | os.PathLike) -> Engine:
    """Load an engine file: checks magic, version, checksum and device, maps the weights."""
    ef = fmt.read_engine(path)
    h = ef.header
    dev = h.get("device", {}).get("kind", "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise EngineFileError(
            f"'{path}' was built for CUDA ({h['device'].get('name')}), and this machine has no "
            "CUDA device; rebuild it here with `kiln build --device cpu`")
    choices: dict[str, str] = {}
    try:
        graph = PlanReader(ef.tensors).graph(h["plan"], choices)
    except (KeyError, TypeError, ValueError) as e:
        raise EngineFileError(f"'{path}' has a damaged plan ({type(e).__name__}: {e}); "
                              "rebuild the engine") from None
    return Engine(graph, choices, device=dev,
                  profiles=[Profile.from_json(p) for p in h.get("profiles", [])],
                  build=h.get("build"), header={k: v for k, v in h.items() if k != "plan"})


class ExecutionContext:
    """Runs an engine. Contexts of one engine may run at the same time from different threads.

    ``run({name: array})`` checks every input before any work is done (missing or unknown
    names, dtype, rank, fixed dims, optimization-profile ranges) and raises
    :class:`kiln.errors.ShapeError` naming the input. Outputs come back as the inputs came:
    numpy in, numpy out; torch in, torch out.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.profile: int | None = None  # set to pin a profile; None picks the first that fits
        self.last_profile = -1
        self._lock = threading.Lock()  # one run at a time per context

    def run(self, feeds: dict) -> dict:
        eng = self.engine
        profiles = eng.profiles
        if self.profile is not None:
            profiles = [eng.profiles[self.profile]]
        with self._lock:
            self.last_profile = check_feeds(eng.inputs, feeds, profiles, dtype_of)
            as_torch = any(isinstance(x, torch.Tensor) for x in feeds.values())
            args = [to_torch(np.asarray(feeds[i.name]) if not isinstance(
                feeds[i.name], torch.Tensor) else feeds[i.name]) for i in eng.inputs]
            outs = eng._executor.run(args)
        conv = (lambda t: t) if as_torch else to_numpy
        return {o.name: conv(v) for o, v in zip(eng.outputs, outs)}


def _precision(node) -> str:
    t = node.outputs[0].type if node.outputs else None
    dt = getattr(t, "dtype", None)
    return dt.name if dt is not None and dt.is_float else "-"


def _triton_version():
    try:
        import importlib.metadata as md
        return md.version("triton")
    except Exception:
        return None
