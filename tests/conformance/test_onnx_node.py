"""The node test cases shipped inside the installed ``onnx`` package, run through
``kiln.onnx_backend``. Skips live in skips.txt beside this file, one line per case."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from onnx.backend.test.loader import load_model_tests
    from onnx.backend.test.runner import Runner, _normalize_tensor

    CASES = load_model_tests(kind="node")

import kiln.onnx_backend as backend
from bench.conformance import read_skips

SKIPS = read_skips(pathlib.Path(__file__).parent / "skips.txt")


@pytest.mark.conformance
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_onnx_node(case):
    if case.name in SKIPS:
        pytest.skip(SKIPS[case.name])
    rep = backend.prepare(case.model, "CPU")
    for inputs, refs in case.data_sets:
        outs = rep.run([_normalize_tensor(x) for x in inputs])
        with np.errstate(all="ignore"):
            Runner.assert_similar_outputs(
                [_normalize_tensor(x) for x in refs], list(outs), rtol=case.rtol, atol=case.atol)
