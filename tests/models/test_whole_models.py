"""Whole-model FP32 accuracy of kiln against onnxruntime on the kiln.zoo reference models.

Every output of kiln must match onnxruntime (CPUExecutionProvider, basic graph optimizations)
on the same inputs to a relative error of at most 1e-4, where

    rel_err(a, b) = max|a - b| / max(max|b|, tiny)

with ``a`` kiln's output, ``b`` onnxruntime's and ``tiny`` the smallest normal float32.
Models are exported once into the kiln cache dir (``KILN_CACHE_DIR``, see
``kiln.zoo.cache_dir``) and prepared once per session; the dynamic-shape tests re-run the same
prepared model with another batch/sequence length.
"""

from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from kiln.zoo import build_onnx, minilm_tokenize, sample_inputs  # noqa: E402

RTOL = 1e-4
TINY = float(np.finfo(np.float32).tiny)

SENTENCES = [
    "kiln compiles ONNX graphs into fast torch programs.",
    "The weather was cold, but the kiln kept the workshop warm all night long.",
]
MORE_SENTENCES = [
    "A short one.",
    "Transformers encode every token of a sentence in the context of all the other tokens.",
    "Is this the real life? Is this just fantasy?",
]

# name -> (first (batch, seq), second (batch, seq)); resnet50 ignores seq, minilm uses text.
SHAPES = {
    "resnet50": ((1, 0), (2, 0)),
    "bert-base": ((2, 16), (3, 9)),
    "gpt2": ((2, 16), (1, 5)),
    "minilm": ((2, None), (3, None)),
}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max(max|b|, tiny), computed in float64."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a64 - b64)) / max(float(np.max(np.abs(b64))), TINY))


class Prepared:
    """One exported model, prepared once by kiln and by onnxruntime."""

    def __init__(self, name: str):
        import kiln.onnx_backend as backend

        self.name = name
        self.path = build_onnx(name)
        self.kiln = backend.prepare(str(self.path))
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        self.ort = ort.InferenceSession(
            str(self.path), opts, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.ort.get_outputs()]

    def inputs(self, which: int) -> dict[str, np.ndarray]:
        batch, seq = SHAPES[self.name][which]
        if self.name == "minilm":
            return minilm_tokenize((SENTENCES, MORE_SENTENCES)[which])
        return sample_inputs(self.name, batch, seq=seq or 128, seed=which)

    def check(self, which: int) -> None:
        feeds = self.inputs(which)
        expected = self.ort.run(None, feeds)
        got = self.kiln.run(feeds)
        assert len(got) == len(expected)
        for name, a, b in zip(self.output_names, got, expected):
            assert a.shape == b.shape, f"{self.name}:{name} shape {a.shape} != {b.shape}"
            assert np.isfinite(a).all(), f"{self.name}:{name} has non-finite values"
            err = rel_err(a, b)
            assert err <= RTOL, f"{self.name}:{name} rel err {err:.3g} > {RTOL}"


@pytest.fixture(scope="session", params=list(SHAPES))
def model(request) -> Prepared:
    """Each model is prepared once; pytest groups the tests by model, so one is alive at a time."""
    return Prepared(request.param)


def test_matches_onnxruntime(model):
    """resnet50 b1, bert-base (12 layers) b2 s16 padded, gpt2 b2 s16, minilm on real text."""
    model.check(0)


def test_dynamic_shapes(model):
    """A second run of the same prepared model with another batch / sequence length."""
    model.check(1)


def test_inputs_are_padded():
    """The text inputs really exercise the attention mask."""
    bert = sample_inputs("bert-base", 2, seq=16, seed=0)
    assert bert["attention_mask"].min() == 0 and bert["attention_mask"][0].all()
    text = minilm_tokenize(SENTENCES)
    assert text["attention_mask"].min() == 0
    assert (text["input_ids"][:, 0] == 101).all()  # [CLS]
