"""Build-time tactic selection (issue #6), on the CPU: the builder's CUDA path driven by a fake
GPU and a fake clock, the plan's ``tactic`` records, and ``call.tactic`` reaching the kernel."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import numpy as np
import pytest
import torch

import kiln
from kiln.builder import Builder, BuilderConfig, autotune
from kiln.engine import engine as engine_mod
from kiln.engine.engine import Engine
from kiln.engine.executor import Executor
from kiln.engine.serialize import PlanReader, PlanWriter
from kiln.errors import EngineFileError
from kiln.frontend import import_onnx
from kiln.ir import REGISTRY
from kiln.kernels import registry
from kiln.kernels.registry import Kernel, kernels_for
from tests.engine.models import mlp, mlp_reference

MATMUL = REGISTRY.get("", "MatMul")
TACTICS = ({"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": 64})


def _fake_matmul(seen: list, backend: str) -> Kernel:
    """A MatMul kernel that records the tactic each call runs with."""
    def fn(call, a, b):
        seen.append((call.node_name, call.tactic))
        return a @ b
    return Kernel(MATMUL, backend, fn, "FakeMatMul", tactics=TACTICS)


@pytest.fixture
def fake_matmul(monkeypatch):
    """``FakeMatMul`` as MatMul's only CUDA kernel (Triton's, if imported, set aside) and as a
    second CPU kernel after the PyTorch one (so CPU engines can run a plan that names it)."""
    seen: list = []
    monkeypatch.setitem(registry._KERNELS, (MATMUL, "cuda"), [_fake_matmul(seen, "cuda")])
    monkeypatch.setitem(registry._KERNELS, (MATMUL, "cpu"),
                        kernels_for(MATMUL, "cpu") + [_fake_matmul(seen, "cpu")])
    return seen


class FakeClock:
    """``timer(fn) -> ms``: runs fn once; FakeMatMul's time depends on its BLOCK, the PyTorch
    kernel's is fixed."""

    def __init__(self, seen: list, ms: dict, torch_ms: float):
        self.seen, self.ms, self.torch_ms, self.calls = seen, ms, torch_ms, 0

    def __call__(self, fn) -> float:
        n = len(self.seen)
        fn()
        self.calls += 1
        if len(self.seen) == n:  # not FakeMatMul: the PyTorch kernel
            return self.torch_ms
        return self.ms[self.seen[-1][1]["BLOCK"]]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The builder sees a GPU; the tuning run itself stays on the CPU. The engine it makes is
    a CPU one (a CUDA engine needs a real device)."""
    pytest.importorskip("triton")  # the builder's CUDA path imports kiln.kernels.triton
    import kiln.kernels.triton  # noqa: F401  (registered now, before fake_matmul sets it aside)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(autotune, "tune_graph",
                        functools.partial(autotune.tune_graph, device="cpu"))
    made = {}

    def cpu_engine(graph, choices, **kw):
        made.update(choices=choices, tactics=kw.get("tactics"))
        return Engine(graph, choices, **dict(kw, device="cpu"))
    monkeypatch.setattr("kiln.builder.builder.Engine", cpu_engine)
    return made


def test_builder_cuda_picks_kernel_and_tactic_by_timer(fake_gpu, fake_matmul, tmp_path):
    clock = FakeClock(fake_matmul, {16: 0.30, 32: 0.05, 64: 0.10}, torch_ms=0.20)
    lines: list[str] = []
    cache = tmp_path / "timing.json"
    cfg = BuilderConfig(device="cuda", optimize=False, timing_cache=str(cache))
    eng = Builder(cfg, log=lines.append, timer=clock).build(mlp())

    assert fake_gpu["choices"]["fc1"] == fake_gpu["choices"]["fc2"] == "FakeMatMul"
    assert fake_gpu["tactics"] == {"fc1": {"BLOCK": 32}, "fc2": {"BLOCK": 32}}
    assert fake_gpu["choices"]["relu1"] == "TorchRelu"  # no CUDA kernel: PyTorch, untimed
    assert clock.calls == 8  # 2 MatMuls x (3 tactics + PyTorch)
    tuned = [ln for ln in lines if ln.startswith("autotune fc")]
    assert len(tuned) == 2
    assert "FakeMatMul[BLOCK=32] 0.0500 ms (runner-up FakeMatMul[BLOCK=64] 0.1000 ms)" \
        in tuned[0]

    # saved and reloaded: kernel and tactic in the plan, and the tactic reaches the kernel
    path = tmp_path / "m.kiln"
    eng.save(path)
    nodes = {n["name"]: n for n in kiln.engine.format.read_header(path)["plan"]["nodes"]}
    assert nodes["fc1"]["kernel"] == "FakeMatMul" and nodes["fc1"]["tactic"] == {"BLOCK": 32}
    assert "tactic" not in nodes["relu1"]
    loaded = kiln.load(path)
    assert loaded.tactics == {"fc1": {"BLOCK": 32}, "fc2": {"BLOCK": 32}}
    fake_matmul.clear()
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    y = loaded.create_context().run({"x": x})["y"]
    np.testing.assert_allclose(y, mlp_reference(x, mlp()), rtol=1e-4, atol=1e-4)
    assert fake_matmul == [("fc1", {"BLOCK": 32}), ("fc2", {"BLOCK": 32})]

    # a rebuild with the same timing cache times nothing
    assert cache.exists()
    clock2 = FakeClock(fake_matmul, {16: 9, 32: 9, 64: 9}, torch_ms=9)
    Builder(cfg, timer=clock2).build(mlp())
    assert clock2.calls == 0 and fake_gpu["tactics"]["fc1"] == {"BLOCK": 32}


@pytest.mark.parametrize("margin,kept", [(0.25, 64), (0.0, 32)])
def test_builder_plan_margin_keeps_kernels_without_a_first_run_plan(fake_gpu, monkeypatch,
                                                                    margin, kept):
    """BLOCK 32 is fastest but (as cuDNN would) makes a plan at its first call; BLOCK 64 is 20%
    slower: within the default 25% margin the build keeps 64, with margin 0 the fastest
    (``plan_payback=0``: the margin alone; test_autotune covers the payback rule)."""
    seen: list = []
    planning = dataclasses.replace(_fake_matmul(seen, "cuda"),
                                   makes_plan=lambda t: t["BLOCK"] == 32)
    monkeypatch.setitem(registry._KERNELS, (MATMUL, "cuda"), [planning])
    monkeypatch.setitem(registry._KERNELS, (MATMUL, "cpu"),
                        kernels_for(MATMUL, "cpu") + [_fake_matmul(seen, "cpu")])
    clock = FakeClock(seen, {16: 0.30, 32: 0.05, 64: 0.06}, torch_ms=0.20)
    lines: list[str] = []
    cfg = BuilderConfig(device="cuda", optimize=False, plan_margin=margin, plan_payback=0)
    Builder(cfg, log=lines.append, timer=clock).build(mlp())
    assert fake_gpu["tactics"] == {"fc1": {"BLOCK": kept}, "fc2": {"BLOCK": kept}}
    kept_lines = [ln for ln in lines if "layers keep a kernel within 25%" in ln]
    assert len(kept_lines) == (1 if kept == 64 else 0)
    if kept == 64:
        assert "2 layers" in kept_lines[0]
        assert any("runner-up FakeMatMul[BLOCK=32] 0.0500 ms, which loads a CUDA library" in ln
                   for ln in lines)


def _block_per_batch(monkeypatch, best: dict[int, int]):
    """A fake CUDA MatMul kernel whose fastest BLOCK depends on the batch (``best``), and the
    fake clock that times it: (calls seen as (node, tactic, batch), clock)."""
    seen: list = []

    def fn(call, a, b):
        seen.append((call.node_name, call.tactic, a.shape[0]))
        return a @ b
    fake = Kernel(MATMUL, "cuda", fn, "FakeMatMul", tactics=TACTICS)
    monkeypatch.setitem(registry._KERNELS, (MATMUL, "cuda"), [fake])
    monkeypatch.setitem(registry._KERNELS, (MATMUL, "cpu"),
                        kernels_for(MATMUL, "cpu") + [dataclasses.replace(fake, backend="cpu")])

    def clock(f) -> float:
        n = len(seen)
        f()
        if len(seen) == n:
            return 1.0  # the PyTorch kernel
        _, tactic, batch = seen[-1]
        return 0.1 if tactic["BLOCK"] == best[batch] else 0.5
    return seen, clock


def test_each_profile_runs_the_tactics_tuned_at_its_opt_shapes(fake_gpu, monkeypatch,
                                                               tmp_path):
    """Two profiles: batch 2 is fastest with BLOCK 16, batch 64 with BLOCK 64; each input runs
    the tactic of the profile it matches, also after a save and load."""
    best = {2: 16, 64: 64}
    seen, clock = _block_per_batch(monkeypatch, best)

    profiles = [kiln.Profile.fixed({"x": (2, 8)}), kiln.Profile.fixed({"x": (64, 8)})]
    b = Builder(BuilderConfig(device="cuda", optimize=False, profiles=profiles), timer=clock)
    eng = b.build(mlp())
    assert eng.tactics["fc1"] == {"BLOCK": 16}
    assert eng.variants[0][1]["fc1"] == {"BLOCK": 64}
    assert len(b.report["autotune_profiles"]) == 2
    path = tmp_path / "m.kiln"
    eng.save(path)
    loaded = kiln.load(path)
    assert loaded.variants == eng.variants
    ctx = loaded.create_context()
    for batch in (64, 2, 64):
        seen.clear()
        x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
        y = ctx.run({"x": x})["y"]
        np.testing.assert_allclose(y, mlp_reference(x, mlp()), rtol=1e-4, atol=1e-4)
        assert {t["BLOCK"] for _, t, _ in seen} == {best[batch]}
        assert ctx.last_profile == (0 if batch == 2 else 1)


def test_builder_cuda_vendor_kernel_wins_without_tactic(fake_gpu, fake_matmul):
    clock = FakeClock(fake_matmul, {16: 0.3, 32: 0.4, 64: 0.5}, torch_ms=0.1)
    b = Builder(BuilderConfig(device="cuda", optimize=False), timer=clock)
    b.build(mlp())
    assert fake_gpu["choices"]["fc1"] == "TorchMatMul" and fake_gpu["tactics"] == {}
    rep = b.report["autotune"]["fc1"]
    assert rep["kernel"] == "TorchMatMul" and rep["tactic"] is None
    assert tuple(rep["runner_up"]) == ("FakeMatMul[BLOCK=16]", 0.3)


def test_builder_cuda_without_gpu_is_untuned(monkeypatch, fake_matmul):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(autotune, "tune_graph", lambda *a, **k: called.append(1))
    b = Builder(BuilderConfig(device="cuda", optimize=False))
    graph = import_onnx(mlp())
    choices, tactics = b._choose_kernels(graph, b._autotune(graph))
    assert not called and tactics == {} and "autotune" not in b.report
    assert choices["fc1"] == "FakeMatMul"  # as before: the first CUDA kernel, no timing


def test_builder_cpu_is_untuned(monkeypatch):
    monkeypatch.setattr(autotune, "tune_graph", lambda *a, **k: pytest.fail("tuned on cpu"))
    b = Builder(BuilderConfig(device="cpu"))
    eng = b.build(mlp())
    assert eng.tactics == {} and "autotune" not in b.report
    assert all(r["tactic"] is None for r in eng.layers())


def test_plan_round_trip_keeps_tactics():
    graph = import_onnx(mlp())
    choices = {"fc1": "FakeMatMul", "fc2": "TorchMatMul"}
    tactics = {"fc1": {"BLOCK": 64, "WARPS": 4}}
    w = PlanWriter()
    plan = json.loads(json.dumps(w.graph(graph, choices, tactics)))
    recs = {n["name"]: n for n in plan["nodes"]}
    assert recs["fc1"]["tactic"] == {"BLOCK": 64, "WARPS": 4}
    assert "tactic" not in recs["fc2"] and recs["fc2"]["kernel"] == "TorchMatMul"
    got_c, got_t = {}, {}
    PlanReader(w.tensors).graph(plan, got_c, got_t)
    assert got_c == choices and got_t == tactics


def test_executor_passes_tactic_to_kernel(fake_matmul):
    graph = import_onnx(mlp())

    def choose(node, backend):
        if node.op is MATMUL:
            return kernels_for(MATMUL, "cpu")[-1]  # FakeMatMul
        return kernels_for(node.op, "cpu")[0]
    ex = Executor(graph, "cpu", choose, tactics={"fc2": {"BLOCK": 16}})
    ex.run([torch.ones(2, 8)])
    assert fake_matmul == [("fc1", None), ("fc2", {"BLOCK": 16})]


def test_plan_tactic_that_is_not_an_object_is_refused():
    graph = import_onnx(mlp())
    w = PlanWriter()
    plan = w.graph(graph, {}, {})
    plan["nodes"][0]["tactic"] = [1, 2]
    with pytest.raises(TypeError):
        PlanReader(w.tensors).graph(plan, {}, {})


def test_cuda_engine_naming_triton_kernels_needs_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "kiln.kernels.triton", None)  # import fails
    with pytest.raises(EngineFileError, match="TritonMatMul.*Triton cannot be imported"):
        engine_mod._register_cuda_kernels("m.kiln", {"fc1": "TritonMatMul", "r": "TorchRelu"})
    engine_mod._register_cuda_kernels("m.kiln", {"fc1": "TorchMatMul"})  # PyTorch only: fine


def test_cuda_engine_naming_triton_kernels_needs_triton_installed(monkeypatch):
    # the kernels import without Triton (they make their Triton functions on first compile),
    # so the load checks that Triton is there at all
    pytest.importorskip("kiln.kernels.triton")
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed
    with pytest.raises(EngineFileError, match="TritonMatMul.*Triton cannot be imported"):
        engine_mod._register_cuda_kernels("m.kiln", {"fc1": "TritonMatMul"})


@pytest.mark.parametrize("tune_at", ["all", "opt"])
def test_one_dynamic_profile_runs_kernels_tuned_at_min_opt_and_max(fake_gpu, monkeypatch,
                                                                   tmp_path, tune_at):
    """One profile batch 1..64 (opt 8): BLOCK 16 is fastest at b1, 32 at b8, 64 at b64.
    tune_at="all" times all three and each batch runs the tactic of the first tuning point at
    least as large (b1 -> 16, b5 -> 32, b30 and b64 -> 64), also after a save and load;
    tune_at="opt" runs BLOCK 32 everywhere."""
    best = {1: 16, 8: 32, 64: 64}
    seen, clock = _block_per_batch(monkeypatch, best)

    profile = kiln.Profile({"x": (1, 8)}, {"x": (8, 8)}, {"x": (64, 8)})
    b = Builder(BuilderConfig(device="cuda", optimize=False, profiles=[profile],
                              tune_at=tune_at), timer=clock)
    eng = b.build(mlp())
    path = tmp_path / "m.kiln"
    eng.save(path)
    loaded = kiln.load(path)
    want = ({1: 16, 5: 32, 8: 32, 30: 64, 64: 64} if tune_at == "all" else
            {1: 32, 5: 32, 30: 32, 64: 32})
    assert len(b.report.get("autotune_profiles", [None])) == (3 if tune_at == "all" else 1)
    assert [len(x) for x in loaded.buckets] == ([3] if tune_at == "all" else [])
    for engine in (eng, loaded):
        ctx = engine.create_context()
        for batch, block in want.items():
            seen.clear()
            x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
            y = ctx.run({"x": x})["y"]
            np.testing.assert_allclose(y, mlp_reference(x, mlp()), rtol=1e-4, atol=1e-4)
            assert {t["BLOCK"] for _, t, _ in seen} == {block}, batch
            assert ctx.last_profile == 0
    with pytest.raises(ValueError, match="tune_at"):
        BuilderConfig(tune_at="max")
