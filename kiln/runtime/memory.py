"""How much device memory an engine takes: weights + peak activations + workspace."""

from __future__ import annotations

import numpy as np
import torch

METHOD = ("weights: bytes of the constants resident on the device; activations: "
          "torch.cuda.max_memory_allocated() during one eager run (random floats, zero "
          "integers; the shapes given, else the first profile's opt shapes) minus "
          "memory_allocated() before it; "
          "workspace: device tensors the kernels keep between runs (e.g. transposed weights) "
          "plus what the first run left allocated (library workspaces). Only torch's caching "
          "allocator is seen. graph_buffers (not in total): what a context that replays a "
          "CUDA graph keeps allocated besides, its static input and output buffers at these "
          "shapes (device outputs are returned as copies of the latter); it also keeps about "
          "one activation peak reserved in its graph pool.")


def measure_device_memory(engine, shapes: dict | None = None) -> dict:
    """See :meth:`kiln.engine.Engine.device_memory`. Resets torch's peak-memory statistics."""
    from kiln.engine.inputs import tuning_inputs

    ex = engine._executor
    if engine.torch_device is None:
        return {"weights": engine.weight_bytes, "activations": None, "workspace": None,
                "total": engine.weight_bytes, "method": "CPU engine: the weights' host bytes "
                "(memory-mapped from the engine file); nothing measured"}
    dev = engine.torch_device
    profile = engine.profiles[0] if engine.profiles else None
    # zero integers (valid indices): random ones past an embedding's end assert on the device
    feeds = tuning_inputs(engine.inputs, profile, seed=0, override=shapes)
    ctx = engine.create_context()
    ctx.cuda.never = "measuring memory"  # eager: the activation peak of the launches alone
    torch.cuda.synchronize(dev)
    base, cached0 = torch.cuda.memory_allocated(dev), _cache_bytes(ex)
    ctx.run(feeds)  # warm-up: kernel caches, cuBLAS/cuDNN workspaces
    torch.cuda.synchronize(dev)
    grown, cached = torch.cuda.memory_allocated(dev) - base, _cache_bytes(ex)
    workspace = cached + max(0, grown - (cached - cached0))
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    outs = ctx.run(feeds)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - before
    weights = ex.device_weight_bytes
    io = [*feeds.values(), *outs.values()]
    return {"weights": weights, "activations": activations, "workspace": workspace,
            "total": weights + activations + workspace,
            "graph_buffers": sum(a.nbytes for a in io if isinstance(a, np.ndarray)),
            "shapes": {k: list(v.shape) for k, v in feeds.items()}, "method": METHOD}


def _cache_bytes(ex) -> int:
    """Device tensors the kernels keep in their nodes' caches."""
    seen, total = set(), 0
    for st in ex.steps:
        for t in st.call.cache.values():
            if isinstance(t, torch.Tensor) and t.device.type == "cuda" and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
