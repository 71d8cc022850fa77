"""kiln as an ``onnx.backend`` backend, so ONNX's own test cases can run through it.

    import kiln.onnx_backend as backend
    rep = backend.prepare(model)          # ModelProto, path or bytes
    outputs = rep.run([x])                # numpy in, numpy out

``prepare(model, "CUDA")`` builds a CUDA engine (strict FP32: TF32 off, so ONNX's tolerances
hold); its runs take numpy in, put every input on the GPU and return numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
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
        args = [_in(a) for a in args]
        if self.engine.torch_device is None:
            outs = self.executor.run(args)
        else:
            outs = self._run_cuda(args)
        return namedtupledict("Outputs", [v.name for v in self.graph.outputs])(
            *[_out(o) for o in outs])


    def _run_cuda(self, args: list) -> list:
        from kiln.runtime.cuda import math_flags

        dev = self.engine.torch_device
        with math_flags(bool(self.engine.build_info.get("tf32", False))):
            return self.executor.run([_to_device(a, dev) for a in args])


def _to_device(a, dev):
    if isinstance(a, list):
        return [_to_device(x, dev) for x in a]
    return a.to(dev) if isinstance(a, torch.Tensor) else a


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
        kind = Device(device).type
        if not cls.supports_device(device):
            raise ValueError(f"kiln.onnx_backend: device {device!r} is not available here "
                             "(CPU always is; CUDA needs a CUDA GPU)")
        cfg = BuilderConfig(optimize=optimize, device="cuda" if kind == DeviceType.CUDA
                            else "cpu", tf32=False)
        return KilnRep(Builder(cfg, log=kwargs.get("log")).build(model))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        kind = Device(device).type
        return kind == DeviceType.CPU or (kind == DeviceType.CUDA and torch.cuda.is_available())

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device).run(inputs)


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
supports_device = KilnBackend.supports_device
