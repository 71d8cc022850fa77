"""Which layers must stay in higher precision: ``kiln debug precision``.

1. Build FP32 and INT8 engines (calibration once, through a cache file); score = the metric
   of the INT8 engine's outputs against FP32's on the evaluation batches.
2. If the all-INT8 engine misses the target: each INT8 layer's sensitivity is the score of an
   engine where it alone runs in INT8.
3. Bisect over the layers sorted most sensitive first: the smallest ``k`` such that keeping
   the top ``k`` in FP32 meets the target (the score is taken as monotone in ``k``).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

_METRIC = re.compile(r"^\s*(cos|max_abs|mean_abs)\s*(>=|<=)\s*([0-9.eE+-]+)\s*$")


def parse_metric(text: str) -> tuple[str, str, float]:
    m = _METRIC.match(text or "")
    if not m:
        raise KilnError(f"bad --metric '{text}': write e.g. 'cos>=0.999' or 'max_abs<=0.01'")
    return m.group(1), m.group(2), float(m.group(3))


def score(got: list[dict], ref: list[dict], kind: str) -> float:
    """cos: the mean over samples of per-sample cosine (worst output); max_abs/mean_abs: the
    worst output's error. Batches may differ in shape (sequence lengths)."""
    vals = []
    for name in ref[0]:
        per = []
        for gb, rb in zip(got, ref):
            g = np.asarray(gb[name], np.float64).reshape(len(gb[name]), -1)
            r = np.asarray(rb[name], np.float64).reshape(len(rb[name]), -1)
            if kind == "cos":
                den = np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1)
                per.append((g * r).sum(1) / np.maximum(den, 1e-30))
            else:
                per.append(np.abs(g - r).ravel())
        allv = np.concatenate(per)
        vals.append(float(allv.mean() if kind in ("cos", "mean_abs") else allv.max()))
    return min(vals) if kind == "cos" else max(vals)


def meets(value: float, op: str, target: float) -> bool:
    return value >= target if op == ">=" else value <= target


def search(model, calib, metric: str, eval_batches=None, calibrator="auto",
           asymmetric=None, log=print, smoothing=0.5) -> tuple[list[str], float]:
    """(layers to keep in FP32, the score with them kept); see the module docstring."""
    from kiln.builder import Builder, BuilderConfig

    kind, op, target = parse_metric(metric)
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "calib.cache")

        def build(keep=()):
            cfg = BuilderConfig(int8=True, calib=calib, calibrator=calibrator,
                                calib_cache=cache, int8_asymmetric=asymmetric,
                                int8_smoothing=smoothing,
                                layer_precision={k: "fp32" for k in keep}, check_finite=False)
            b = Builder(cfg)
            return b.build(str(model)), b.report["int8"]["int8"]

        fp32 = Builder(BuilderConfig()).build(str(model))
        engine, layers = build()
        if eval_batches is None:
            from kiln.passes.quantize.data import load_batches

            eval_batches = load_batches(calib, [i.name for i in engine.inputs])
        ref = [fp32.create_context().run(b) for b in eval_batches]

        def value(keep) -> float:
            e, _ = (engine, None) if not keep else build(keep)
            return score([e.create_context().run(b) for b in eval_batches], ref, kind)

        base = value(())
        log(f"all {len(layers)} INT8 layers: {kind} = {base:.6f}")
        if meets(base, op, target):
            return [], base
        short = [n.split(" + ")[0] for n in layers]
        sens = {}
        for s in short:
            sens[s] = value([t for t in short if t != s])
            log(f"  only {s} in INT8: {kind} = {sens[s]:.6f}")
        order = sorted(short, key=lambda s: sens[s], reverse=(op == "<="))
        lo, hi = 1, len(order)  # keeping everything meets the target by construction
        best = (order, value(order))
        while lo < hi:
            mid = (lo + hi) // 2
            v = value(order[:mid])
            log(f"  {mid} layer(s) kept in FP32: {kind} = {v:.6f}")
            if meets(v, op, target):
                hi, best = mid, (order[:mid], v)
            else:
                lo = mid + 1
        if hi == len(order):
            best = (order, value(order))
        return best
