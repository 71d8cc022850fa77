"""CPU builds time the GEMM and conv tactics: the picks travel in the engine file (a loaded
engine's first run times nothing) and in the timing cache (a rebuild times nothing). Timing is
counted in calls to the tactic timer, not in seconds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native
from kiln.engine import format as fmt
from kiln.kernels.torch import fused_conv as FCK


def _model(path):
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32),
                                       name)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("GlobalAveragePool", ["c2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 10, 10])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 12])],
        [init("w1", 16, 8, 3, 3), init("b1", 16), init("w2", 32, 16, 1, 1), init("w3", 12, 32),
         init("b3", 12)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def timed(monkeypatch):
    """Counts calls to the CPU tactic timer; the process-wide picks start empty."""
    calls = []
    orig = FCK._select

    def spy(fns, *a, **k):
        calls.append(sorted(fns))
        return orig(fns, *a, **k)
    monkeypatch.setattr(FCK, "_choices", {})
    monkeypatch.setattr(FCK, "_FORCED", "")
    monkeypatch.setattr(FCK, "_FORCED_CONV", "")
    monkeypatch.setattr(FCK, "_select", spy)
    return calls


@pytest.mark.skipif(not native.available, reason="kiln's conv tactics need kiln.native")
def test_engine_carries_tactics_and_first_run_times_nothing(tmp_path, timed, monkeypatch):
    model = _model(tmp_path / "m.onnx")
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(model))
    assert timed, "the build timed no tactic"
    assert engine.cpu_tactics and set(engine.cpu_tactics.values()) <= set(
        FCK.TACTICS + FCK.CONV_TACTICS)
    engine.save(tmp_path / "m.kiln")
    header = fmt.read_engine(tmp_path / "m.kiln").header
    assert len(header["cpu_tactics"]) == len(engine.cpu_tactics)
    x = np.random.default_rng(1).standard_normal((1, 8, 10, 10)).astype(np.float32)
    want = engine.create_context().run({"x": x})["y"]
    monkeypatch.setattr(FCK, "_choices", {})  # as in a fresh process
    timed.clear()
    loaded = kiln.load(tmp_path / "m.kiln")
    got = loaded.create_context().run({"x": x})["y"]
    assert timed == []
    assert loaded.cpu_tactics == engine.cpu_tactics
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not native.available, reason="kiln's conv tactics need kiln.native")
def test_warm_timing_cache_rebuild_times_nothing(tmp_path, timed, monkeypatch):
    model = _model(tmp_path / "m.onnx")
    cfg = kiln.BuilderConfig(device="cpu", timing_cache=str(tmp_path / "cache.json"))
    first = kiln.Builder(cfg).build(str(model))
    assert timed
    monkeypatch.setattr(FCK, "_choices", {})
    timed.clear()
    builder = kiln.Builder(cfg)
    second = builder.build(str(model))
    assert timed == []
    assert second.cpu_tactics == first.cpu_tactics
    assert builder.report["cpu_tactics"]["cached"] == len(first.cpu_tactics)


def test_damaged_cpu_tactics_are_refused():
    with pytest.raises(ValueError, match="malformed CPU tactic table"):
        FCK.picks_from_json([["not", "a", "pair"]])
