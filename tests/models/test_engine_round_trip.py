"""Build -> save -> load -> run on the four reference models: the loaded engine gives the same
outputs as the in-memory one, with two contexts running at once from two threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kiln
from kiln.zoo import build_onnx, sample_inputs

CASES = {"resnet50": dict(batch=1), "bert-base": dict(batch=2, seq=16),
         "gpt2": dict(batch=2, seq=16), "minilm": dict(batch=2, seq=16)}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_round_trip_reference_model(name, tmp_path):
    engine = kiln.Builder().build(build_onnx(name))
    feeds = [sample_inputs(name, seed=s, **CASES[name]) for s in (0, 1)]
    want = [engine.create_context().run(f) for f in feeds]
    engine.save(tmp_path / f"{name}.kiln")
    del engine
    loaded = kiln.load(tmp_path / f"{name}.kiln")
    got: list = [None, None]

    def work(k):
        ctx = loaded.create_context()
        got[k] = [ctx.run(feeds[k]) for _ in range(2)]

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):
        for run in got[k]:
            assert set(run) == set(want[k])
            for out, w in want[k].items():
                # a signature's first run is the traced one (PyTorch's GEMMs), later ones the
                # native program's (kiln's): FP32 rounding apart, and which of the two contexts
                # traces is a race
                np.testing.assert_allclose(run[out], w, rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name} output {out}, context {k}")
