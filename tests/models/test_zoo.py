"""kiln.zoo plumbing: cache keying, atomic reuse, options, sample inputs (onnxruntime only)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kiln.zoo import build_onnx, cache_dir, list_models, sample_inputs

TINY_BERT = {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64, "vocab": 500,
             "max_positions": 64}


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cache_dir_env(tmp_cache):
    assert cache_dir() == tmp_cache / "zoo"


def test_build_is_cached_and_keyed_by_options(tmp_cache):
    first = build_onnx("bert-base", **TINY_BERT)
    assert first.parent == tmp_cache / "zoo" and first.stat().st_size > 0
    start = time.perf_counter()
    assert build_onnx("bert-base", **TINY_BERT) == first
    assert time.perf_counter() - start < 0.5
    other = build_onnx("bert-base", **{**TINY_BERT, "layers": 2})
    assert other != first and first.exists()
    assert not list((tmp_cache / "zoo").glob(".*.tmp"))


def test_explicit_path_and_onnxruntime(tmp_cache):
    ort = pytest.importorskip("onnxruntime")
    dest = build_onnx("bert-base", path=tmp_cache / "tiny.onnx", **TINY_BERT)
    sess = ort.InferenceSession(str(dest), providers=["CPUExecutionProvider"])
    for batch, seq in ((2, 8), (3, 5)):
        feeds = sample_inputs("bert-base", batch, seq=seq, vocab=TINY_BERT["vocab"])
        (out,) = sess.run(None, feeds)
        assert out.shape == (batch, seq, TINY_BERT["hidden"]) and np.isfinite(out).all()


def test_unknown_name_and_option():
    with pytest.raises(ValueError, match="unknown"):
        build_onnx("vgg16")
    with pytest.raises(ValueError, match="options"):
        build_onnx("resnet50", layers=2)


@pytest.mark.parametrize("name", list_models())
def test_sample_inputs(name):
    feeds = sample_inputs(name, 2, seq=12)
    assert feeds and all(isinstance(v, np.ndarray) for v in feeds.values())
    again = sample_inputs(name, 2, seq=12)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
