"""Engine API: build, save, load, run; input checks; profiles; concurrent contexts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kiln
from kiln import Profile, ShapeError
from tests.engine.models import mlp, mlp_reference, two_inputs


@pytest.fixture(scope="module")
def model():
    return mlp()


def test_engine_round_trip_matches_in_memory(model, tmp_path):
    engine = kiln.Builder().build(model)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    want = engine.create_context().run({"x": x})["y"]
    engine.save(tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    got = loaded.create_context().run({"x": x})["y"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, mlp_reference(x, model), rtol=1e-5, atol=1e-5)


def test_engine_describes_inputs_outputs(model):
    engine = kiln.Builder().build(model)
    (i,), (o,) = engine.inputs, engine.outputs
    assert (i.name, i.dtype.name, i.shape_str()) == ("x", "float32", "[batch, 8]")
    assert (o.name, o.dtype.name, o.shape_str()) == ("y", "float32", "[batch, 4]")
    assert [r["op"] for r in engine.layers()].count("MatMul") >= 1


def test_engine_torch_in_torch_out(model):
    ctx = kiln.Builder().build(model).create_context()
    out = ctx.run({"x": torch.ones(2, 8)})["y"]
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 4)
    out_np = ctx.run({"x": np.ones((2, 8), np.float32)})["y"]
    assert isinstance(out_np, np.ndarray)
    # the first run is the traced one (PyTorch's GEMM), the second the native program's
    np.testing.assert_allclose(out.numpy(), out_np, rtol=1e-5, atol=1e-6)


def test_engine_concurrent_contexts_agree(model, tmp_path):
    kiln.Builder().build(model).save(tmp_path / "m.kiln")
    engine = kiln.load(tmp_path / "m.kiln")
    xs = [np.random.default_rng(s).standard_normal((4, 8)).astype(np.float32) for s in range(2)]
    want = [mlp_reference(x, model) for x in xs]
    errors = []

    def work(k):
        ctx = engine.create_context()
        for _ in range(50):
            got = ctx.run({"x": xs[k]})["y"]
            if not np.allclose(got, want[k], rtol=1e-5, atol=1e-5):
                errors.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("feeds, message", [
    ({}, "missing input"),
    ({"x": np.ones((1, 8), np.float32), "z": np.ones(1, np.float32)}, "unknown input"),
    ({"x": np.ones((1, 8), np.float64)}, "dtype float64"),
    ({"x": np.ones((8,), np.float32)}, "rank 1"),
    ({"x": np.ones((1, 9), np.float32)}, "dim 1 must be 8"),
])
def test_engine_refuses_bad_inputs(model, feeds, message):
    ctx = kiln.Builder().build(model).create_context()
    with pytest.raises(ShapeError, match=message):
        ctx.run(feeds)


@pytest.mark.parametrize("feeds, message", [
    ({"x": np.ones((1, 8), np.float64)}, "dtype float64"),
    ({"x": np.ones((1, 9), np.float32)}, "dim 1 must be 8"),
    ({"x": torch.ones(1, 8, dtype=torch.float16)}, "dtype float16"),
    ({"x": np.ones((1, 8), np.float32), "z": np.ones(1, np.float32)}, "unknown input"),
])
def test_engine_refuses_bad_inputs_after_good_ones(model, feeds, message):
    """The checks a context remembers (per names, types, dtypes and shapes of the feeds) do
    not let another feed through."""
    ctx = kiln.Builder().build(model).create_context()
    good = {"x": np.ones((1, 8), np.float32)}
    for _ in range(2):
        ctx.run(good)
        with pytest.raises(ShapeError, match=message):
            ctx.run(feeds)
    assert ctx.run(good)["y"].shape == (1, 4)


def test_engine_refuses_shape_outside_profiles(model):
    cfg = kiln.BuilderConfig(profiles=[Profile({"x": (1, 8)}, {"x": (4, 8)}, {"x": (8, 8)}),
                                       Profile.fixed({"x": (32, 8)})])
    ctx = kiln.Builder(cfg).build(model).create_context()
    assert ctx.run({"x": np.ones((5, 8), np.float32)})["y"].shape == (5, 4)
    assert ctx.last_profile == 0
    ctx.run({"x": np.ones((32, 8), np.float32)})
    assert ctx.last_profile == 1
    with pytest.raises(ShapeError, match=r"input 'x' has shape 9x8, outside every optimization"
                                         r" profile \(profile 0: 1x8 \.\. 8x8; profile 1"):
        ctx.run({"x": np.ones((9, 8), np.float32)})


def test_builder_takes_profiles_none_as_no_profiles(model):
    """``profiles=None`` (bench.corpus passed it on CUDA) builds as the default does."""
    eng = kiln.Builder(kiln.BuilderConfig(profiles=None)).build(model)
    assert eng.profiles == []
    assert eng.create_context().run({"x": np.ones((3, 8), np.float32)})["y"].shape == (3, 4)


def test_engine_pinned_profile(model):
    cfg = kiln.BuilderConfig(profiles=[Profile.fixed({"x": (2, 8)}),
                                       Profile.fixed({"x": (4, 8)})])
    ctx = kiln.Builder(cfg).build(model).create_context()
    ctx.profile = 1
    with pytest.raises(ShapeError, match="outside every"):
        ctx.run({"x": np.ones((2, 8), np.float32)})


def test_engine_profiles_survive_save(model, tmp_path):
    p = Profile({"x": (1, 8)}, {"x": (4, 8)}, {"x": (8, 8)})
    kiln.Builder(kiln.BuilderConfig(profiles=[p])).build(model).save(tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    assert loaded.profiles == [p]
    assert loaded.profile_ranges("x") == [((1, 8), (4, 8), (8, 8))]
    with pytest.raises(KeyError, match="no input 'q'"):
        loaded.profile_ranges("q")


def test_engine_refuses_profile_that_does_not_fit_model(model):
    with pytest.raises(ShapeError, match="fixes it at 8"):
        kiln.Builder(kiln.BuilderConfig(profiles=[Profile.fixed({"x": (2, 3)})])).build(model)
    with pytest.raises(ShapeError, match="does not have"):
        kiln.Builder(kiln.BuilderConfig(profiles=[Profile.fixed({"q": (2, 8)})])).build(model)
    bad = Profile({"x": (4, 8)}, {"x": (2, 8)}, {"x": (8, 8)})
    with pytest.raises(ShapeError, match="min <= opt <= max"):
        kiln.Builder(kiln.BuilderConfig(profiles=[bad])).build(model)


def test_engine_symbolic_dims_must_agree():
    ctx = kiln.Builder().build(two_inputs()).create_context()
    a = np.ones((2, 3), np.float32)
    assert ctx.run({"a": a, "b": a})["y"].shape == (2, 3)
    with pytest.raises(ShapeError, match="'seq'"):
        ctx.run({"a": a, "b": np.ones((2, 4), np.float32)})
