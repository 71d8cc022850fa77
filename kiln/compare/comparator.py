"""Comparator: run two runners on the same inputs and compare output by output, or layer by
layer.

Per tensor: max absolute and relative error, mean absolute error, cosine similarity, and pass
or fail against ``atol + rtol * |ref|`` elementwise (numpy's ``allclose`` rule). Layer by
layer, the first layer whose cosine to the reference falls below ``cos_jump`` is named: where
the error comes from, as opposed to where it shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Metrics:
    name: str
    max_abs: float
    max_rel: float
    mean_abs: float
    cosine: float
    passed: bool

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}  {self.name}: max abs {self.max_abs:.3g}, max rel "
                f"{self.max_rel:.3g}, mean abs {self.mean_abs:.3g}, cosine {self.cosine:.6f}")


def metrics(name: str, got, ref, atol: float = 1e-5, rtol: float = 1e-3) -> Metrics:
    g = np.asarray(got, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    if g.shape != r.shape:
        return Metrics(name, float("inf"), float("inf"), float("inf"), 0.0, False)
    if g.size == 0:
        return Metrics(name, 0.0, 0.0, 0.0, 1.0, True)
    d = np.abs(g - r)
    denom = np.linalg.norm(g) * np.linalg.norm(r)
    cos = float(g @ r / denom) if denom > 0 else float(np.array_equal(g, r))
    rel = d / np.maximum(np.abs(r), 1e-12)
    ok = bool(np.all(d <= atol + rtol * np.abs(r)))
    return Metrics(name, float(d.max()), float(rel.max()), float(d.mean()), cos, ok)


def tolerance(spec: str | None, name: str, default: float) -> float:
    """``"1e-3"`` for every output, or ``"out1:1e-3,out2:1e-2"`` per output."""
    if not spec:
        return default
    if ":" not in spec:
        return float(spec)
    per = dict(item.rsplit(":", 1) for item in spec.split(","))
    return float(per[name]) if name in per else default


def compare_outputs(runner, ref, batches, atol=None, rtol=None) -> list[Metrics]:
    """Metrics per output over ``batches`` (concatenated along the first axis)."""
    got_all: dict[str, list] = {}
    ref_all: dict[str, list] = {}
    for b in batches:
        for k, v in runner.run(b).items():
            got_all.setdefault(k, []).append(np.asarray(v).ravel())
        for k, v in ref.run(b).items():
            ref_all.setdefault(k, []).append(np.asarray(v).ravel())
    out = []
    for k in got_all:
        if k not in ref_all:
            continue
        out.append(metrics(k, np.concatenate(got_all[k]), np.concatenate(ref_all[k]),
                           tolerance(atol, k, 1e-5), tolerance(rtol, k, 1e-3)))
    return out


def compare_layers(runner, ref, feeds, cos_jump: float = 0.999) -> tuple[list, str | None]:
    """(metrics per intermediate both runners show, in the runner's order; the first layer
    whose cosine falls below ``cos_jump``, or None)."""
    got = runner.run_all(feeds)
    want = ref.run_all(feeds, names=set(got))
    layer = runner.layer_of() if hasattr(runner, "layer_of") else {}
    rows, first = [], None
    for name, g in got.items():
        if name not in want or np.asarray(g).dtype.kind not in "f":
            continue
        m = metrics(name, g, want[name])
        rows.append((layer.get(name, name), m))
        if first is None and m.cosine < cos_jump:
            first = layer.get(name, name)
    return rows, first
