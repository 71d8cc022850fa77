"""Calibrator math against hand-computed histograms, and the calibration cache."""

import struct

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.passes.quantize import cache as C
from kiln.passes.quantize.calibrate import (
    EntropyCalibrator,
    Histogram,
    MinMaxCalibrator,
    PercentileCalibrator,
    entropy_threshold,
    kl_divergence,
    percentile_threshold,
    quantize_bins,
)


def test_minmax_takes_largest_abs_over_batches():
    c = MinMaxCalibrator()
    c.collect("a", np.array([0.5, -2.0, 1.0], np.float32))
    c.collect("a", np.array([1.5, -0.25], np.float32))
    assert c.amax() == {"a": 2.0}
    assert c.mins == {"a": -2.0}


def test_histogram_bins_abs_values():
    h = Histogram(bins=4)
    h.add(np.array([0.1, -0.9, 2.0, -4.0], np.float32))  # top 4, width 1
    assert h.top == 4.0
    np.testing.assert_array_equal(h.counts, [2, 0, 1, 1])  # 4.0 lands in the last bin


def test_histogram_regrows_by_bin_centres():
    h = Histogram(bins=4)
    h.add(np.array([0.5, 1.5, 2.5, 3.5], np.float32))  # one per bin, top 3.5
    h.add(np.array([7.0], np.float32))  # top 7: old centres 0.4375.. 3.0625 -> bins 0,0,1,1
    np.testing.assert_array_equal(h.counts, [2, 2, 0, 1])


def test_percentile_threshold_hand_computed():
    counts = np.array([50, 30, 15, 4, 1], float)  # cdf .5 .8 .95 .99 1.0, width 0.5
    assert percentile_threshold(counts, 0.5, 80.0) == pytest.approx(1.0)  # edge of bin 1
    assert percentile_threshold(counts, 0.5, 96.0) == pytest.approx(2.0)  # bin 3
    assert percentile_threshold(counts, 0.5, 100.0) == pytest.approx(2.5)


def test_quantize_bins_spreads_over_nonempty_bins():
    # 8 bins into 2 levels of 4: [4, 0, 2, 2] -> mass 8 over 3 non-empty bins
    q = quantize_bins(np.array([4, 0, 2, 2, 1, 1, 1, 1], float), levels=2)
    np.testing.assert_allclose(q, [8 / 3, 0, 8 / 3, 8 / 3, 1, 1, 1, 1])


def test_quantize_bins_last_level_takes_remainder():
    q = quantize_bins(np.array([1, 1, 1, 1, 1, 3, 2], float), levels=3)  # groups 2, 2, 3
    np.testing.assert_allclose(q, [1, 1, 1, 1, 2, 2, 2])


def test_kl_divergence_hand_computed():
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    want = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    assert kl_divergence(p, q) == pytest.approx(want, rel=1e-3)  # smoothing moves no mass here
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-12)


def test_entropy_threshold_hand_computed_small():
    # 4 levels, candidates i = 4..8 over 8 bins of width 1. Mass sits in the first 4 bins, one
    # outlier in bin 7: at i = 4 P folds the outlier into bin 3 and Q cannot follow it; at
    # i = 8 every bin is its own pair of bins merged into 4 levels.
    counts = np.array([10, 8, 6, 4, 0, 0, 0, 1], float)
    kls = {}
    for i in range(4, 9):
        p = counts[:i].copy()
        p[i - 1] += counts[i:].sum()
        kls[i] = kl_divergence(p, quantize_bins(counts[:i], p != 0, 4))
    best = min(kls, key=kls.get)
    assert entropy_threshold(counts, 1.0, levels=4) == pytest.approx(best * 1.0)
    assert best == 4  # clipping the lone outlier costs less than coarser bins everywhere


def test_entropy_clips_outliers_of_a_gaussian():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_000).astype(np.float32)
    x[:3] = [40.0, -35.0, 30.0]  # outliers stretch max |x| to 40
    c, m = EntropyCalibrator(), MinMaxCalibrator()
    c.collect("x", x)
    m.collect("x", x)
    amax = c.amax()["x"]
    assert m.amax()["x"] == 40.0
    assert 2.0 < amax < 10.0  # near the bulk of N(0, 1), not the outliers


def test_percentile_calibrator_of_uniform():
    x = np.linspace(-1, 1, 100_001, dtype=np.float32)
    c = PercentileCalibrator(99.0)
    c.collect("x", x)
    assert c.amax()["x"] == pytest.approx(0.99, abs=2e-3)


def test_cache_round_trip(tmp_path):
    scales = {"input": (0.0123, 128), "/layer/out:0": (1.5e-3, 128)}
    C.write_cache(tmp_path / "c.cache", "EntropyCalibration2", scales)
    text = (tmp_path / "c.cache").read_text().splitlines()
    assert text[0] == "TRT-8601-EntropyCalibration2"
    assert f"input: {struct.pack('>f', 0.0123).hex()}" in text
    algo, back = C.read_cache(tmp_path / "c.cache")
    assert algo == "EntropyCalibration2"
    assert set(back) == set(scales)
    for k, (s, z) in scales.items():
        assert back[k] == (np.float32(s), z)


def test_cache_round_trip_asymmetric(tmp_path):
    C.write_cache(tmp_path / "c", "MinMaxCalibration", {"a": (0.5, 3)}, asymmetric=True)
    assert C.read_cache(tmp_path / "c") == ("MinMaxCalibrationAsymmetric", {"a": (0.5, 3)})


def test_cache_refuses_other_calibrator(tmp_path):
    with pytest.raises(KilnError, match="made by MinMaxCalibration, not EntropyCalibration2"):
        C.check_cache("c", "MinMaxCalibration", "EntropyCalibration2", {"a": (1, 128)}, {"a"})


def test_cache_refuses_other_model():
    with pytest.raises(KilnError, match="1 tensor.*missing.*b.*1 tensor.*not in the model.*c"):
        C.check_cache("f", "E", "E", {"a": (1, 128), "c": (1, 128)}, {"a", "b"})


@pytest.mark.parametrize("text,err", [
    ("garbage\n", "first line should read"),
    ("TRT-8601-EntropyCalibration2\nx: zz\n", "line 2: 'zz' is not the hex"),
    ("TRT-8601-EntropyCalibration2\nno colon\n", "line 2"),
])
def test_cache_refuses_malformed(tmp_path, text, err):
    (tmp_path / "c").write_text(text)
    with pytest.raises(KilnError, match=err):
        C.read_cache(tmp_path / "c")


def _entropy_by_the_book(counts, width, levels):
    """EntropyCalibrator2 written out loop by loop: for each candidate i, P = first i bins
    with the tail folded into bin i - 1, Q = those i bins (tail not folded) merged into
    ``levels`` groups (the last takes the remainder), each group's mass spread evenly over
    the bins where P is non-empty; threshold = (i of least KL(P || Q)) * width."""
    best, best_i = np.inf, None
    for i in range(levels, len(counts) + 1):
        p = counts[:i].astype(np.float64).copy()
        p[i - 1] += counts[i:].sum()
        q = np.zeros(i)
        per = i // levels
        for j in range(levels):
            a, b = j * per, (i if j == levels - 1 else (j + 1) * per)
            nz = p[a:b] != 0
            if nz.any():
                q[a:b][nz] = counts[a:b].sum() / nz.sum()
        pn, qn = p / p.sum(), q / q.sum()
        kl = float(np.sum(pn * np.log(pn / qn)))
        if kl < best:
            best, best_i = kl, i
    return best_i * width


@pytest.mark.parametrize("levels", [4, 16])
def test_entropy_threshold_equals_the_loop_by_loop_algorithm(levels):
    """On histograms without empty bins (where the KL smoothing moves nothing) kiln's
    vectorised threshold is the book algorithm's, bin for bin."""
    rng = np.random.default_rng(levels)
    for _ in range(5):
        n = int(rng.integers(3 * levels, 8 * levels))
        counts = np.floor(1000 * np.exp(-np.linspace(0, 4, n) ** 2) + rng.integers(1, 5, n))
        counts[-1] += rng.integers(0, 50)  # a heavy last bin: outliers
        assert entropy_threshold(counts, 0.5, levels=levels) == pytest.approx(
            _entropy_by_the_book(counts, 0.5, levels))

