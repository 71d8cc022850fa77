"""MiniLM with random weights (``weights="random"``): built, exported and run through kiln on a
machine without the weights package or a tokenizer, matching PyTorch; same architecture as the
real all-MiniLM-L6-v2 where the package is installed."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import kiln
from kiln.zoo import build_onnx, minilm, sample_inputs

RANDOM = {"weights": "random"}
RTOL = 1e-4
needs_package = pytest.mark.skipif(not minilm.has_package(),
                                   reason=f"{minilm.PACKAGE} is not installed")


def block_real_weights(mp: pytest.MonkeyPatch) -> None:
    """Make the weights package and the tokenizer/safetensors libraries unimportable."""
    for name in (minilm.PACKAGE, "tokenizers", "safetensors", "safetensors.torch"):
        mp.setitem(sys.modules, name, None)


def build_torch(seed: int = 0) -> torch.nn.Module:
    """As bench.peers.build_module and the zoo export do it: global seed, then build."""
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        model, _ = minilm.build(**RANDOM)
    return model.eval()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a64 - b64)) / np.max(np.abs(b64)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The random variant exported into a fresh cache with the real weights unreachable."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        block_real_weights(mp)
        assert not minilm.has_package()
        return build_onnx("minilm", **RANDOM)


def test_minilm_random_sample_inputs_without_tokenizer(monkeypatch):
    block_real_weights(monkeypatch)
    feeds = sample_inputs("minilm", 3, seq=16, **RANDOM)
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    assert ids.shape == mask.shape == (3, 16) and ids.dtype == mask.dtype == np.int64
    assert mask[0].all() and mask.min() == 0  # padded rows exercise the attention mask
    assert (ids[:, 0] == 101).all() and ids.max() < minilm.CONFIG.vocab
    assert (ids[mask == 0] == 0).all()
    again = sample_inputs("minilm", 3, seq=16, **RANDOM)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)


def test_minilm_bad_weights_option():
    with pytest.raises(ValueError, match="weights"):
        minilm.build(weights="pretrained")
    with pytest.raises(ValueError, match="options"):
        build_onnx("minilm", layers=2)


def test_minilm_random_build_is_seeded():
    a, b, c = build_torch(0).state_dict(), build_torch(0).state_dict(), build_torch(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["encoder.layer.0.attention.self.query.weight"],
                           c["encoder.layer.0.attention.self.query.weight"])


@pytest.mark.parametrize("batch,seq", [(2, 16), (3, 9)])
def test_minilm_random_kiln_matches_torch(exported, batch, seq):
    feeds = sample_inputs("minilm", batch, seq=seq, seed=batch, **RANDOM)
    with torch.no_grad():
        want = build_torch()(*(torch.from_numpy(feeds[n]) for n in minilm.INPUT_NAMES)).numpy()
    got = kiln.Builder().build(exported).create_context().run(feeds)
    (out,) = got.values()
    assert out.shape == (batch, seq, minilm.CONFIG.hidden) and np.isfinite(out).all()
    assert rel_err(out, want) <= RTOL


@needs_package
def test_minilm_config_matches_package():
    assert minilm.config() == minilm.CONFIG


@needs_package
def test_minilm_random_has_real_architecture():
    real = minilm.load_model().state_dict()
    rand = build_torch().state_dict()
    assert {k: v.shape for k, v in rand.items()} == {k: v.shape for k, v in real.items()}
    assert {k: v.dtype for k, v in rand.items()} == {k: v.dtype for k, v in real.items()}
    assert not torch.equal(rand["embeddings.word_embeddings.weight"],
                           real["embeddings.word_embeddings.weight"])
