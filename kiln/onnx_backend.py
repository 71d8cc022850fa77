"""kiln as an ``onnx.backend`` backend, so ONNX's own test cases can run through it.

    import kiln.onnx_backend as backend
    rep = backend.prepare(model)          # ModelProto, path or bytes
    outputs = rep.run([x])                # numpy in, numpy out
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from kiln.builder import Builder, BuilderConfig
from kiln.kernels.torch.convert import to_numpy, to_torch


class KilnRep(BackendRep):
    """A built engine (full optimizer pipeline on), run without the engine's input checks so
    ONNX's test cases can omit optional inputs."""

    def __init__(self, engine):
        self.engine = engine
        self.graph = engine.graph
        self.executor = engine._executor

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        names = [v.name for v in self.graph.inputs]
        if isinstance(inputs, dict):
            args = [inputs.get(n) for n in names]
        else:
            if not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            args = list(inputs) + [None] * (len(names) - len(inputs))
        outs = self.executor.run([_in(a) for a in args])
        return namedtupledict("Outputs", [v.name for v in self.graph.outputs])(
            *[_out(o) for o in outs])


def _in(a):
    if isinstance(a, (list, tuple)):
        return [_in(x) for x in a]
    if a is None:
        return None
    return to_torch(np.asarray(a) if not hasattr(a, "dtype") else a)


def _out(o):
    if isinstance(o, (list, tuple)):
        return [_out(x) for x in o]
    return to_numpy(o)


class KilnBackend(Backend):
    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs: Any) -> KilnRep:
        optimize = kwargs.get("optimize", True)
        return KilnRep(Builder(BuilderConfig(optimize=optimize)).build(model))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device).run(inputs)


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
supports_device = KilnBackend.supports_device
