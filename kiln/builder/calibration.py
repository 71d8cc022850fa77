"""INT8 for the Builder: where each activation's scale comes from, then the rewrite.

In order: the model's own Q/DQ scales (explicit quantization), a calibration cache that
matches, or calibration — the optimized FP32 graph run over the calibration batches, every
INT8 layer's input seen by the calibrator — after which the cache is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.engine.executor import Executor
from kiln.engine.tap import run_tapped
from kiln.errors import KilnError
from kiln.ir import Graph
from kiln.passes.quantize import cache as C
from kiln.passes.quantize.calibrate import make_calibrator
from kiln.passes.quantize.data import load_batches
from kiln.passes.quantize.int8 import candidate, quantize_graph, scales_from_amax


def needed_tensors(graph: Graph) -> set[str]:
    """Names of the activations the INT8 layers of ``graph`` read (pins aside)."""
    return {n.inputs[0].name for n in graph.nodes if candidate(n) is None}


def calibrate(graph: Graph, batches, calibrator: str = "entropy", device: str = "cpu",
              log=lambda m: None):
    """The calibrator (``algorithm``, ``amax()``, ``mins``) after it saw ``graph``'s INT8
    layer inputs over ``batches``."""
    needed = needed_tensors(graph)
    cal = make_calibrator(calibrator)
    ex = Executor(graph, device)
    batches = load_batches(batches, [v.name for v in graph.inputs])
    for b in batches:
        run_tapped(ex, b, lambda name, x, node: cal.collect(name, x), needed)
    log(f"calibration: {cal.algorithm} over {len(batches)} batch(es), {len(needed)} tensors")
    return cal


def int8_scales(graph: Graph, cfg, log=lambda m: None) -> dict[str, tuple[float, int]]:
    """The activation scales an INT8 build of ``graph`` uses (see the module docstring)."""
    needed = needed_tensors(graph)
    want = make_calibrator(cfg.calibrator).algorithm + (
        "Asymmetric" if cfg.int8_asymmetric else "")
    path = cfg.calib_cache
    if path and Path(path).exists():
        algorithm, scales = C.read_cache(path)
        C.check_cache(path, algorithm, want, scales, needed)
        log(f"calibration: {len(scales)} scales read from {path} ({algorithm})")
        return scales
    if cfg.calib is None:
        raise KilnError("--int8 needs calibration data (--calib DIR or FILE.py), a calibration "
                        "cache (--calib-cache FILE), or a model with QuantizeLinear/"
                        "DequantizeLinear nodes")
    cal = calibrate(graph, cfg.calib, cfg.calibrator, _calib_device(cfg), log)
    scales = scales_from_amax(cal.amax(), *((cal.mins, cal.maxs) if cfg.int8_asymmetric
                                             else (None, None)))
    if path:
        C.write_cache(path, cal.algorithm, scales, cfg.int8_asymmetric)
        log(f"calibration: cache written to {path}")
    return scales


def _calib_device(cfg) -> str:
    import torch

    return "cuda" if cfg.device == "cuda" and torch.cuda.is_available() else "cpu"


def apply_int8(graph: Graph, cfg, explicit: dict | None, log=lambda m: None,
               grid=None) -> dict:
    """Quantize ``graph`` in place for an INT8 build: returns the rewrite's report."""
    keep = {k for k, p in cfg.layer_precision.items() if p not in ("int8", "fp8")}
    scales = explicit if explicit else int8_scales(graph, cfg, log)
    if explicit:
        log(f"int8: explicit quantization, {len(explicit)} scale(s) from the model's "
            "quantization nodes")
    fp8 = cfg.fp8 and not explicit
    if fp8 and cfg.int8_asymmetric:
        raise KilnError("FP8 layers are symmetric: drop --asymmetric for an --fp8 build")
    return quantize_graph(graph, scales, keep, log, fp8=fp8, grid=grid)


def first_nonfinite(ex: Executor, feeds: dict[str, np.ndarray]) -> tuple[str, str] | None:
    """``(layer, tensor)`` of the first layer whose output holds NaN or Inf on ``feeds``."""
    found: list = []

    def look(name, x, node):
        if not found and node is not None and x.dtype.kind == "f" and not np.isfinite(x).all():
            found.append((node.name, name))

    run_tapped(ex, feeds, look)
    return found[0] if found else None
