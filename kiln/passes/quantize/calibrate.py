"""Calibrators: from activation values seen on calibration data to one INT8 range per tensor.

Every calibrator returns ``amax`` per tensor: the symmetric range ``[-amax, amax]`` mapped onto
the INT8 levels, so the scale is ``amax / 127``.

- :class:`MinMaxCalibrator`: ``amax = max |x|`` over all batches.
- :class:`PercentileCalibrator`: the ``percentile`` (99.99) of ``|x|``, read off a histogram.
- :class:`AutoCalibrator` (the default): min-max for matrix products' inputs, entropy for
  the rest, as TensorRT recommends per network kind (NLP / CNN).
- :class:`EntropyCalibrator`: TensorRT's EntropyCalibrator2. A 2048-bin histogram of ``|x|``
  over ``[0, max|x|]``; for every candidate ``i`` from 128 to 2048 bins, the reference
  distribution P is the first ``i`` bins with everything beyond folded into bin ``i - 1``, and Q
  is those ``i`` bins (without the folded tail) merged into 128 levels, each level's mass spread
  back evenly over the bins where P is non-empty; the threshold is the upper edge of bin
  ``i - 1`` for the ``i`` of least KL(P || Q).

The histograms grow as batches come: a batch with a larger ``|x|`` re-bins what was collected
(each old bin's count moves to the new bin holding its centre).
"""

from __future__ import annotations

import numpy as np

BINS = 2048
LEVELS = 128  # quantized levels of |x| (0..127)
_EPS = 1e-4  # KL smoothing: mass moved onto Q's empty bins


class Calibrator:
    """Collects ``|x|`` statistics per tensor name; :meth:`amax` gives the ranges. Every
    calibrator also keeps each tensor's smallest and largest values (``mins``, ``maxs``),
    which asymmetric quantization uses."""

    algorithm = ""  # the name in the calibration cache header

    def __init__(self):
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def collect(self, name: str, x: np.ndarray) -> None:
        if x.size:
            self.mins[name] = min(self.mins.get(name, 0.0), float(np.min(x)))
            self.maxs[name] = max(self.maxs.get(name, 0.0), float(np.max(x)))
        self._collect(name, x)

    def _collect(self, name: str, x: np.ndarray) -> None:
        raise NotImplementedError

    def amax(self) -> dict[str, float]:
        raise NotImplementedError


class MinMaxCalibrator(Calibrator):
    algorithm = "MinMaxCalibration"

    def __init__(self):
        super().__init__()
        self.max: dict[str, float] = {}

    def _collect(self, name, x):
        m = float(np.max(np.abs(x))) if x.size else 0.0
        self.max[name] = max(self.max.get(name, 0.0), m)

    def amax(self):
        return dict(self.max)


class Histogram:
    """A histogram of ``|x|`` over ``[0, top]`` in :data:`BINS` bins; ``top`` grows."""

    def __init__(self, bins: int = BINS):
        self.bins = bins
        self.counts = np.zeros(bins, dtype=np.float64)
        self.top = 0.0

    @property
    def width(self) -> float:
        return self.top / self.bins

    def add(self, x: np.ndarray) -> None:
        a = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        a = a[np.isfinite(a)]
        if a.size == 0:
            return
        m = float(a.max())
        if m > self.top:
            self._regrow(m)
        if self.top == 0.0:  # all zeros so far: everything in bin 0
            self.counts[0] += a.size
            return
        idx = np.minimum((a / self.width).astype(np.int64), self.bins - 1)
        self.counts += np.bincount(idx, minlength=self.bins)

    def _regrow(self, top: float) -> None:
        if self.top > 0.0 and self.counts.any():
            centres = (np.arange(self.bins) + 0.5) * self.width
            idx = np.minimum((centres / (top / self.bins)).astype(np.int64), self.bins - 1)
            self.counts = np.bincount(idx, weights=self.counts, minlength=self.bins)
        self.top = top


class _HistogramCalibrator(Calibrator):
    def __init__(self, bins: int = BINS):
        super().__init__()
        self.bins = bins
        self.hists: dict[str, Histogram] = {}

    def _collect(self, name, x):
        self.hists.setdefault(name, Histogram(self.bins)).add(x)

    def amax(self):
        return {k: float(self.threshold(h)) for k, h in self.hists.items()}

    def threshold(self, h: Histogram) -> float:
        raise NotImplementedError


class PercentileCalibrator(_HistogramCalibrator):
    algorithm = "PercentileCalibration"

    def __init__(self, percentile: float = 99.99, bins: int = BINS):
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], not {percentile}")
        super().__init__(bins)
        self.percentile = percentile

    def threshold(self, h):
        return percentile_threshold(h.counts, h.width, self.percentile)


class EntropyCalibrator(_HistogramCalibrator):
    algorithm = "EntropyCalibration2"

    def threshold(self, h):
        return entropy_threshold(h.counts, h.width)


def percentile_threshold(counts: np.ndarray, width: float, percentile: float) -> float:
    """Upper edge of the first bin where the cumulative count reaches ``percentile`` %."""
    total = counts.sum()
    if total == 0:
        return 0.0
    cdf = np.cumsum(counts) / total
    i = int(np.searchsorted(cdf, percentile / 100.0 - 1e-12))
    return (min(i, len(counts) - 1) + 1) * width


def quantize_bins(counts: np.ndarray, mask: np.ndarray | None = None,
                  levels: int = LEVELS) -> np.ndarray:
    """Q for a candidate of ``len(counts)`` bins: the bins merged into ``levels`` groups of
    ``len(counts) // levels`` (the last group takes the remainder), each group's mass spread
    evenly over its bins where ``mask`` (default: ``counts != 0``) is set."""
    i = len(counts)
    mask = (counts != 0) if mask is None else mask
    group = np.minimum(np.arange(i) // (i // levels), levels - 1)
    mass = np.bincount(group, weights=counts, minlength=levels)
    n = np.bincount(group, weights=mask.astype(np.float64), minlength=levels)
    per = np.divide(mass, n, out=np.zeros(levels), where=n > 0)
    return np.where(mask, per[group], 0.0)


def _smooth(d: np.ndarray, eps: float = _EPS) -> np.ndarray | None:
    zero = d == 0
    n_zero, n_nz = int(zero.sum()), int((~zero).sum())
    if n_nz == 0:
        return None
    d = d / d.sum()
    # a bin left below zero by the move (a tiny mass among many empty bins) stays just above
    return np.maximum(d + eps * zero - (eps * n_zero / n_nz) * ~zero, 1e-12)


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(P || Q) of two histograms (normalised here; Q smoothed so it has no empty bin
    where P has mass)."""
    ps, qs = _smooth(p.astype(np.float64)), _smooth(q.astype(np.float64))
    if ps is None or qs is None:
        return float("inf")
    m = ps > 0
    return float(np.sum(ps[m] * np.log(ps[m] / qs[m])))


def entropy_threshold(counts: np.ndarray, width: float, levels: int = LEVELS,
                      start: int | None = None) -> float:
    """The EntropyCalibrator2 threshold of a ``|x|`` histogram (see the module docstring)."""
    counts = np.asarray(counts, dtype=np.float64)
    nbins = len(counts)
    start = levels if start is None else start
    if counts.sum() == 0 or nbins <= start:
        return nbins * width
    tail = np.concatenate([np.cumsum(counts[::-1])[::-1], [0.0]])  # tail[i] = sum(counts[i:])
    best, best_i = float("inf"), nbins
    for i in range(start, nbins + 1):
        if counts[i - 1] == 0 and i < nbins and tail[i] == 0:
            continue  # nothing at or beyond this bin changes P
        p = counts[:i].copy()
        p[i - 1] += tail[i]
        q = quantize_bins(counts[:i], p != 0, levels)
        kl = kl_divergence(p, q)
        if kl < best:
            best, best_i = kl, i
    return best_i * width


class AutoCalibrator(EntropyCalibrator):
    """TensorRT's advice per tensor: min-max for the inputs of matrix products (TensorRT:
    "preferred for NLP tasks"; the entropy threshold clips transformers' outlier channels,
    which the network depends on), EntropyCalibrator2 for the rest (convolutions: "preferred
    for CNNs"). ``minmax_names``: the tensors that take min-max (set by the caller)."""

    algorithm = "AutoCalibration"

    def __init__(self, bins: int = BINS):
        super().__init__(bins)
        self.minmax_names: set[str] = set()

    def amax(self):
        out = super().amax()
        for k in out:
            if k in self.minmax_names:
                out[k] = max(-self.mins.get(k, 0.0), self.maxs.get(k, 0.0))
        return out


CALIBRATORS = {"auto": AutoCalibrator, "entropy": EntropyCalibrator,
               "percentile": PercentileCalibrator, "minmax": MinMaxCalibrator}


def make_calibrator(kind: str) -> Calibrator:
    """A calibrator by its CLI name: ``auto`` (default), ``entropy``, ``percentile`` or
    ``minmax``."""
    if kind not in CALIBRATORS:
        raise ValueError(f"unknown calibrator {kind!r}: choose one of {sorted(CALIBRATORS)}")
    return CALIBRATORS[kind]()
