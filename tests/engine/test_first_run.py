"""A loaded CPU engine's first run: what it would do once (time tactics, trace and plan the
native program, pack weights) is done at build or by ``warm_up``, asserted on counters, not on
timing; and OpenMP's wait policy that ``import kiln`` sets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native, settings
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops.rules import broadcast_ints

ROOT = Path(__file__).resolve().parents[2]


def _init(rng, name, *shape):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)


def _conv_model(path):
    """1x1 and 3x3 convs (kiln's GEMM and Winograd), a depthwise one, pooling and a Gemm."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], group=16, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c2", "w3"], ["c3"]),
             helper.make_node("GlobalAveragePool", ["c3"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "w4", "b4"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 12, 12])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 10])],
        [_init(rng, "w1", 16, 8, 3, 3), _init(rng, "b1", 16), _init(rng, "w2", 16, 1, 3, 3),
         _init(rng, "w3", 32, 16, 1, 1), _init(rng, "w4", 10, 32), _init(rng, "b4", 10)])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _token_model(path):
    """Integer token ids -> embedding Gather -> MatMul + bias -> Expand: an encoder's first
    layers."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("MatMul", ["e", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["mb"]),
             helper.make_node("Expand", ["mb", "shape"], ["y"])]
    shape = numpy_helper.from_array(np.array([2, 1, 1], dtype=np.int64), "shape")
    g = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info(
        "ids", TensorProto.INT64, [1, 6])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 6, 24])],
        [_init(rng, "table", 50, 16), _init(rng, "w", 16, 24), _init(rng, "b", 24), shape])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def counted(monkeypatch):
    """Counts tactic timings, conv tactic plans and weight packings (kiln's own kernels); the
    process-wide tactic picks start empty."""
    calls = {"select": 0, "plan_conv": 0, "pack": 0}

    def spy(fn, key):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(FCK, "_choices", {})
    monkeypatch.setattr(FCK, "_FORCED", "")
    monkeypatch.setattr(FCK, "_FORCED_CONV", "")
    monkeypatch.setattr(FCK, "_select", spy(FCK._select, "select"))
    monkeypatch.setattr(FCK, "_plan_conv", spy(FCK._plan_conv, "plan_conv"))
    if native.available:
        for cls in (native.PackedWeight, native.WinogradWeight, native.DepthwiseWeight):
            monkeypatch.setattr(cls, "__init__", spy(cls.__init__, "pack"))
    return calls


@pytest.mark.skipif(not native.available, reason="native programs need kiln.native")
def test_warm_up_leaves_the_first_run_nothing_to_do(tmp_path, counted, monkeypatch):
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(
        str(_conv_model(tmp_path / "m.onnx")))
    engine.save(tmp_path / "m.kiln")
    x = np.random.default_rng(1).standard_normal((1, 8, 12, 12)).astype(np.float32)
    want = engine.create_context().run({"x": x})["y"]

    monkeypatch.setattr(FCK, "_choices", {})  # as in a fresh process
    for k in counted:
        counted[k] = 0
    loaded = kiln.load(tmp_path / "m.kiln", warm_up=True)
    assert loaded.warm_up_notes == []
    program = loaded._executor.program
    assert program is not None and program.traced == 1 and len(program.plans) == 1
    assert counted["select"] == 0  # the build's picks came with the file
    assert counted["pack"] > 0 and counted["plan_conv"] > 0  # done by warm_up
    for k in counted:
        counted[k] = 0
    got = loaded.create_context().run({"x": x})["y"]
    assert counted == {"select": 0, "plan_conv": 0, "pack": 0}
    assert program.traced == 1  # ran the program planned at load: no trace, no planning
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not native.available, reason="kiln's GEMM tactic needs kiln.native")
def test_integer_input_engine_carries_its_tactics(tmp_path, counted, monkeypatch):
    monkeypatch.setattr(FCK, "KILN_BELOW", 0)  # the model's small GEMMs timed, not just taken
    monkeypatch.setattr(FCK, "KILN_FEW_ROWS_BELOW", 0)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(
        str(_token_model(tmp_path / "t.onnx")))
    assert counted["select"] > 0, "the build's tuning run timed nothing"
    assert engine.cpu_tactics
    engine.save(tmp_path / "t.kiln")
    ids = np.array([[3, 7, 0, 49, 12, 5]], dtype=np.int64)
    want = engine.create_context().run({"ids": ids})["y"]
    monkeypatch.setattr(FCK, "_choices", {})
    counted["select"] = 0
    loaded = kiln.load(tmp_path / "t.kiln")
    got = loaded.create_context().run({"ids": ids})["y"]
    assert counted["select"] == 0
    assert loaded.cpu_tactics == engine.cpu_tactics
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_warm_up_notes_what_it_could_not_run(tmp_path):
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(
        str(_token_model(tmp_path / "t.onnx")))
    engine._executors = [_Failing()]
    engine._executor = engine._executors[0]
    assert engine.warm_up() == 0
    assert len(engine.warm_up_notes) == 1 and "boom" in engine.warm_up_notes[0]


class _Failing:
    def run(self, args):
        raise RuntimeError("boom")


def test_first_run_does_not_import_torch_symbolic_shapes(tmp_path):
    """torch.broadcast_shapes' first call imports torch's sympy machinery (~0.2 s of a first
    run); the CPU kernels broadcast without it."""
    kiln.Builder(kiln.BuilderConfig(device="cpu")).build(
        str(_token_model(tmp_path / "t.onnx"))).save(tmp_path / "t.kiln")
    code = ("import sys, numpy as np, kiln\n"
            f"e = kiln.load({str(tmp_path / 't.kiln')!r})\n"
            "before = 'torch.fx.experimental.symbolic_shapes' in sys.modules\n"
            "e.create_context().run({'ids': np.zeros((1, 6), np.int64)})\n"
            "print(before, 'torch.fx.experimental.symbolic_shapes' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_broadcast_ints():
    assert broadcast_ints((1, 3), (2, 1)) == (2, 3)
    assert broadcast_ints((5,), (2, 1, 1)) == (2, 1, 5)
    assert broadcast_ints((0,), (1,)) == (0,)
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_ints((2,), (3,))


@pytest.mark.parametrize("env, modules, found, policy", [
    ({}, {}, "kiln", "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {}, "user", "ACTIVE"),
    ({"GOMP_SPINCOUNT": "10000"}, {}, "user", None),
    ({"KILN_OMP_PASSIVE": "0"}, {}, "off", None),
    ({}, {"torch": object()}, "late", None),
])
def test_omp_wait_policy(env, modules, found, policy, monkeypatch):
    monkeypatch.setattr(settings, "omp_wait_policy_source", "")
    assert settings.apply_omp_wait_policy(env, modules) == found
    assert env.get("OMP_WAIT_POLICY") == policy
    assert settings.omp_wait_policy_source == found


def test_import_kiln_first_makes_openmp_passive():
    code = ("import os, kiln, torch\n"
            "from kiln import settings\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), settings.omp_wait_policy_source)\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in settings.OMP_WAIT_VARS + ("KILN_OMP_PASSIVE",)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PASSIVE", "kiln"]


def test_torch_first_warns_once(monkeypatch):
    import torch

    monkeypatch.setattr(settings, "omp_wait_policy_source", "late")
    monkeypatch.setattr(settings, "_warned", False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.warns(RuntimeWarning, match="Import kiln before torch"):
        assert settings.warn_if_spinning()
    assert not settings.warn_if_spinning()


def test_dim_expressions_are_parsed_once():
    """An engine file of a model with dynamic H and W repeats a few dim expressions hundreds of
    times (PaddleOCR det v4: 522 of 27); each is parsed once per process."""
    import sympy

    from kiln.ir.types import dim_from_str, sym

    a = dim_from_str("ceiling(ceiling(H/2)/2) + 1")
    assert a is dim_from_str("ceiling(ceiling(H/2)/2) + 1")
    assert sympy.simplify(a - (sympy.ceiling(sympy.ceiling(sym("H") / 2) / 2) + 1)) == 0
    assert dim_from_str("7") == 7 and dim_from_str("?") is None


def test_load_and_first_run_hold_the_garbage_collector(tmp_path, monkeypatch):
    """Loading and the first run's trace and plan run with the cyclic collector off (a full
    collection there walks the whole process, 100+ ms with torch imported, for objects that
    live as long as the engine); it is on again after each, a caller's own ``gc.disable()`` is
    kept, and the outputs are the built engine's (to rounding: the loaded one runs its own
    picks)."""
    import gc

    from kiln.engine import engine as engine_mod
    from kiln.engine import program

    engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(
        str(_conv_model(tmp_path / "c.onnx")))
    engine.save(tmp_path / "c.kiln")
    x = np.random.default_rng(1).standard_normal((1, 8, 12, 12)).astype(np.float32)
    want = engine.create_context().run({"x": x})["y"]
    inside, seen = [], {"in": 0, "out": 0}

    def marked(fn):
        def wrapped(*a, **k):
            inside.append(1)
            try:
                return fn(*a, **k)
            finally:
                inside.pop()
        return wrapped
    monkeypatch.setattr(engine_mod, "_load", marked(engine_mod._load))
    monkeypatch.setattr(program.Program, "_trace", marked(program.Program._trace))

    def cb(phase, info):
        if phase == "start":
            seen["in" if inside else "out"] += 1
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, where one may run
    gc.callbacks.append(cb)
    try:
        loaded = kiln.load(tmp_path / "c.kiln")
        assert gc.isenabled()
        first = loaded.create_context().run({"x": x})["y"]
        second = loaded.create_context().run({"x": x})["y"]
        assert gc.isenabled()
        gc.disable()
        try:  # a caller's disabled collector stays disabled
            kiln.load(tmp_path / "c.kiln").create_context().run({"x": x})
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(cb)
        gc.set_threshold(*old)
    assert seen["in"] == 0 and seen["out"] > 0
    assert sum(ex.program.traced for ex in loaded._executors if ex.program is not None) == 1
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second, want, rtol=1e-5, atol=1e-6)
