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
from kiln.passes.quantize import smooth as S
from kiln.passes.quantize.calibrate import make_calibrator
from kiln.passes.quantize.data import load_batches
from kiln.passes.quantize.int8 import MATMULS, candidate, quantize_graph, scales_from_amax


def needed_tensors(graph: Graph) -> set[str]:
    """Names of the activations the INT8 layers of ``graph`` read (pins aside)."""
    return {n.inputs[0].name for n in graph.nodes if candidate(n) is None}


def calibrate(graph: Graph, batches, calibrator: str = "entropy", device: str = "cpu",
              log=lambda m: None, smoothing: float = 0.0):
    """The calibrator (``algorithm``, ``amax()``, ``mins``, and ``smooth``: activation name ->
    multipliers) after it saw ``graph``'s INT8 layer inputs over ``batches``. With
    ``smoothing`` (SmoothQuant's alpha, > 0) a first pass measures the per-channel ranges of
    the activations that only matrix products read, and the calibrator sees them smoothed."""
    needed = needed_tensors(graph)
    cal = make_calibrator(calibrator)
    if hasattr(cal, "minmax_names"):  # auto: min-max for what matrix products read
        cal.minmax_names = {n.inputs[0].name for n in graph.nodes
                            if candidate(n) is None and n.op in MATMULS}
    ex = Executor(graph, device)
    batches = load_batches(batches, [v.name for v in graph.inputs])
    mult: dict[str, np.ndarray] = {}
    if smoothing > 0:
        readers = S.smoothable(graph, needed)
        amax: dict[str, np.ndarray] = {}

        def chan(name, x, node):
            a = S.channel_amax(x)
            amax[name] = a if name not in amax else np.maximum(amax[name], a)

        for b in batches:
            run_tapped(ex, b, chan, set(readers))
        mult = {k: S.factors(amax[k], r, smoothing) for k, r in readers.items() if k in amax}
    for b in batches:
        run_tapped(ex, b, lambda name, x, node: cal.collect(
            name, x * mult[name] if name in mult else x), needed)
    cal.smooth = mult
    log(f"calibration: {cal.algorithm} over {len(batches)} batch(es), {len(needed)} tensors"
        + (f", {len(mult)} smoothed (alpha {smoothing})" if smoothing > 0 else ""))
    return cal


def int8_scales(graph: Graph, cfg, log=lambda m: None) -> dict[str, tuple[float, int]]:
    """The activation scales an INT8 build of ``graph`` uses (see the module docstring)."""
    return int8_ranges(graph, cfg, log)[0]


def int8_ranges(graph: Graph, cfg, log=lambda m: None):
    """``(scales, smooth)``: the activation scales an INT8 build of ``graph`` uses and the
    smoothing multipliers (activation name -> per-channel multipliers; empty without
    smoothing) they were calibrated under."""
    needed = needed_tensors(graph)
    smoothing = getattr(cfg, "int8_smoothing", 0.0) or 0.0
    if smoothing > 0 and not S.smoothable(graph, needed):
        smoothing = 0.0  # nothing to smooth (a CNN): the cache is TensorRT's own
    want = make_calibrator(cfg.calibrator).algorithm + (
        "Asymmetric" if asymmetric(cfg) else "") + ("Smoothed" if smoothing > 0 else "")
    path = cfg.calib_cache
    if path and Path(path).exists():
        algorithm, scales = C.read_cache(path)
        C.check_cache(path, algorithm, want, scales, needed)
        log(f"calibration: {len(scales)} scales read from {path} ({algorithm})")
        return scales, (C.read_smoothing(path) if smoothing > 0 else {})
    if cfg.calib is None:
        raise KilnError("--int8 needs calibration data (--calib DIR or FILE.py), a calibration "
                        "cache (--calib-cache FILE), or a model with QuantizeLinear/"
                        "DequantizeLinear nodes")
    cal = calibrate(graph, cfg.calib, cfg.calibrator, _calib_device(cfg), log, smoothing)
    scales = scales_from_amax(cal.amax(), *((cal.mins, cal.maxs) if asymmetric(cfg)
                                             else (None, None)))
    if path:
        C.write_cache(path, cal.algorithm, scales, asymmetric(cfg),
                      cal.smooth if smoothing > 0 else None)
        log(f"calibration: cache written to {path}")
    return scales, cal.smooth


def asymmetric(cfg) -> bool:
    """Whether activations get asymmetric ranges: as asked, else (None) yes for INT8 and no
    for FP8 (whose layers are symmetric)."""
    a = cfg.int8_asymmetric
    return (not cfg.fp8) if a is None else bool(a)


def _calib_device(cfg) -> str:
    import torch

    return "cuda" if cfg.device == "cuda" and torch.cuda.is_available() else "cpu"


def apply_int8(graph: Graph, cfg, explicit: dict | None, log=lambda m: None,
               grid=None) -> dict:
    """Quantize ``graph`` in place for an INT8 build: returns the rewrite's report."""
    keep = {k for k, p in cfg.layer_precision.items() if p not in ("int8", "fp8")}
    scales, smooth = (explicit, {}) if explicit else int8_ranges(graph, cfg, log)
    if explicit:
        log(f"int8: explicit quantization, {len(explicit)} scale(s) from the model's "
            "quantization nodes")
    fp8 = cfg.fp8 and not explicit
    if fp8 and cfg.int8_asymmetric:  # asked for (None: symmetric for FP8)
        raise KilnError("FP8 layers are symmetric: drop --asymmetric for an --fp8 build")
    if smooth:
        scales = dict(scales)
        S.insert_smoothing(graph, smooth, scales, log)
    return quantize_graph(graph, scales, keep, log, fp8=fp8, grid=grid)


def first_nonfinite(ex: Executor, feeds: dict[str, np.ndarray]) -> tuple[str, str] | None:
    """``(layer, tensor)`` where a NaN on ``feeds`` starts, or, where an output of the engine
    is not finite, where that starts: the layer that makes a non-finite value out of finite
    inputs, found by walking back from the first NaN (or the bad output) along non-finite
    tensors. An Inf that stays inside the engine is by design in many models (an additive
    attention mask of -inf, ``Where(mask, -inf, x)`` before a softmax, a float32 minimum that
    FP16 rounds to -inf) and is not reported; a NaN always is."""
    bad: dict[str, object] = {}  # non-finite tensor -> the node making it (None: an input)
    first_nan: list[str] = []

    def look(name, x, node):
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            bad[name] = node
            if not first_nan and np.isnan(x).any():
                first_nan.append(name)

    run_tapped(ex, feeds, look)
    start = first_nan[0] if first_nan else next(
        (v.name for v in ex.graph.outputs if v.name in bad), None)
    if start is None:
        return None
    seen = set()
    while bad.get(start) is not None and start not in seen:
        seen.add(start)
        node = bad[start]
        back = [v.name for v in node.inputs if v is not None and v.name in bad]
        if not back:
            return node.name, start
        start = back[0]
    node = bad.get(start)
    return (node.name, start) if node is not None else None
