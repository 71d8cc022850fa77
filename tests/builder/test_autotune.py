"""Autotuner selection and timing cache, on the CPU with a fake clock (no real timing)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from kiln.builder import autotune
from kiln.builder.autotune import Candidate, TimingCache, candidates, select, signature
from kiln.ir import Attr, OpDef
from kiln.kernels.registry import Call, Kernel, register

DEVICE = {"device": "FakeGPU", "torch": "2.13", "triton": "3.9", "cuda": "13.0"}
OP = OpDef("AutotuneTestOp", {"axis": Attr("int", -1)})
X = torch.ones(4, 8)


class FakeClock:
    """``timer(fn)``: runs fn once (the kernel records who it is) and answers that
    candidate's time from a table; counts how many candidates it timed."""

    def __init__(self, table):
        self.table, self.calls, self.last = table, 0, None

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.table[self.last]


def _kernel(clock, name, backend="cuda", out=None, raises=False):
    def fn(call, x):
        clock.last = (name, json.dumps(call.tactic, sort_keys=True))
        if raises:
            raise RuntimeError("out of shared memory")
        return x * 2 if out is None else out
    return Kernel(OP, backend, fn, name)


def _cands(clock, tactics=({"B": 1}, {"B": 2}), **kw):
    k = _kernel(clock, "TritonFake", **kw)
    torch_k = _kernel(clock, "TorchFake", backend="cpu")
    return [Candidate(k, t) for t in tactics] + [Candidate(torch_k)]


def _call():
    return Call(OP.make_attrs(), 1, 1)


def _key(name, tactic=None):
    return name, json.dumps(tactic, sort_keys=True)


def _select(clock, cands, cache=None, verify=False):
    return select("n1", OP, _call(), (X,), cands, clock, cache, verify=verify)


def test_autotune_selects_fastest_and_reports_runner_up():
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.30, _key("TritonFake", {"B": 2}): 0.10,
                       _key("TorchFake"): 0.20})
    sel = _select(clock, _cands(clock))
    assert (sel.kernel, sel.tactic, sel.ms) == ("TritonFake", {"B": 2}, 0.10)
    assert sel.runner_up == ("TorchFake", 0.20)
    assert sel.timed == 3 and sel.cached == 0 and not sel.failed
    assert "TritonFake[B=2]" in sel.line()


def test_autotune_vendor_kernel_wins_when_fastest():
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.3, _key("TritonFake", {"B": 2}): 0.3,
                       _key("TorchFake"): 0.1})
    sel = _select(clock, _cands(clock))
    assert sel.kernel == "TorchFake" and sel.tactic is None
    assert sel.runner_up == ("TritonFake[B=1]", 0.3)  # a tie keeps registration order


def _plan_cands(clock):
    """TritonFake tactic B=1 and the vendor kernel make a cuDNN plan; tactic B=2 doesn't."""
    k = Kernel(OP, "cuda", _kernel(clock, "TritonFake").fn, "TritonFake",
               makes_plan=lambda t: t["B"] == 1)
    torch_k = Kernel(OP, "cpu", _kernel(clock, "TorchFake", backend="cpu").fn, "TorchFake",
                     makes_plan=lambda t: True)
    return [Candidate(k, {"B": 1}), Candidate(k, {"B": 2}), Candidate(torch_k)]


@pytest.mark.parametrize("plan_free_ms,margin,kept", [
    (0.12, 0.25, "B=2"),  # 20% slower, within 25%: the plan-free tactic
    (0.13, 0.25, "B=1"),  # 30% slower: the fastest, which makes a plan
    (0.11, 0.0, "B=1"),   # no margin: always the fastest
])
def test_autotune_plan_margin_prefers_kernels_without_a_first_run_plan(plan_free_ms, margin,
                                                                      kept):
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.10,
                       _key("TritonFake", {"B": 2}): plan_free_ms, _key("TorchFake"): 0.105})
    sel = select("n1", OP, _call(), (X,), _plan_cands(clock), clock, verify=False,
                 plan_margin=margin)
    assert sel.kernel == "TritonFake" and sel.tactic == {"B": int(kept[-1])}
    assert sel.plan_free == (kept == "B=2")
    if sel.plan_free:  # the faster plan-making one is the runner-up, and the log says why
        assert sel.runner_up == ("TritonFake[B=1]", 0.10) and sel.ms == plan_free_ms
        assert "loads a CUDA library" in sel.line()
    else:
        assert sel.runner_up[0] == "TorchFake"


def _engine_picks(plan_free_ms, other_ms=1.0, plan_free=True):
    """Two tuned layers: n1 picks the plan-making B=1 (0.10 ms; its plan-free B=2 costs
    ``plan_free_ms``, more than 25% slower so the per-layer rule keeps cuDNN), n2 a plan-free
    kernel at ``other_ms``."""
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.10,
                       _key("TritonFake", {"B": 2}): plan_free_ms, _key("TorchFake"): 0.105})
    cands = _plan_cands(clock) if plan_free else [_plan_cands(clock)[0], _plan_cands(clock)[2]]
    n1 = select("n1", OP, _call(), (X,), cands, clock, verify=False, plan_margin=0.25)
    clock2 = FakeClock({_key("TritonFake", {"B": 2}): other_ms})
    n2 = select("n2", OP, _call(), (X,), [Candidate(_kernel(clock2, "TritonFake"), {"B": 2})],
                clock2, verify=False, plan_margin=0.25)
    return {"n1": n1, "n2": n2}


def test_drop_plans_engine_wide_when_cudnn_saves_little():
    """cuDNN saves 0.05 of 1.10 ms (5%, not more than 25%): n1 takes its plan-free tactic and
    the engine makes no plan; the cuDNN pick becomes the runner-up."""
    picks = _engine_picks(0.15)
    assert picks["n1"].library == "cudnn"
    assert picks["n1"].planless[1:] == ("TritonFake", {"B": 2}, 0.15)
    [(lib, n, saved, switched)] = autotune.drop_plans(picks, 0.25)
    assert (lib, n, round(saved, 6), switched) == ("cudnn", 1, 0.05, True)
    s = picks["n1"]
    assert (s.kernel, s.tactic, s.ms, s.library) == ("TritonFake", {"B": 2}, 0.15, None)
    assert s.runner_up == ("TritonFake[B=1]", 0.10) and "loads a CUDA library" in s.line()


@pytest.mark.parametrize("plan_free_ms,other_ms,plan_free", [
    (0.15, 0.05, True),  # saves 0.05 of 0.15 ms (33%): worth the library
    (0.15, 1.0, False),  # n1 has no plan-free candidate: cuDNN is loaded anyway
])
def test_drop_plans_must_not_fire(plan_free_ms, other_ms, plan_free):
    picks = _engine_picks(plan_free_ms, other_ms, plan_free)
    assert [r[3] for r in autotune.drop_plans(picks, 0.25)] == [False]
    assert picks["n1"].library == "cudnn" and picks["n1"].tactic == {"B": 1}
    # margin 0: the fastest always
    assert [r[3] for r in autotune.drop_plans(_engine_picks(0.15), 0.0)] == [False]


def test_autotune_plan_margin_leaves_plan_free_winners_alone():
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.20, _key("TritonFake", {"B": 2}): 0.10,
                       _key("TorchFake"): 0.30})
    sel = select("n1", OP, _call(), (X,), _plan_cands(clock), clock, verify=False,
                 plan_margin=0.5)
    assert sel.tactic == {"B": 2} and not sel.plan_free
    assert sel.runner_up == ("TritonFake[B=1]", 0.20)


def test_conv_kernels_say_which_tactics_make_cudnn_plans():
    pytest.importorskip("triton")
    from kiln.kernels.registry import kernels_for
    from kiln.kernels.triton import conv  # noqa: F401  (registers the CUDA conv)
    from kiln.ops import fused_conv as FC
    from kiln.ops import nn as N

    k = [k for k in kernels_for(FC.FusedConv, "cuda") if k.name == "TritonFusedConv"][0]
    assert k.plans(None) and k.plans({"epilogue": "cudnn"}) and k.plans(
        {"epilogue": "triton", "BLOCK": 1024, "num_warps": 4})
    assert not any(k.plans({"impl": i}) for i in ("gemm", "cublas", "igemm"))
    # the PyTorch conv kernels run cuDNN on CUDA tensors
    for op in (FC.FusedConv, N.Conv, N.ConvTranspose):
        assert kernels_for(op, "cpu")[0].plans(None), op.name
    assert not kernels_for(N.MatMul, "cpu")[0].plans(None)


def test_builder_config_rejects_a_negative_plan_margin():
    from kiln.builder import BuilderConfig
    with pytest.raises(ValueError, match="plan_margin"):
        BuilderConfig(device="cuda", plan_margin=-0.1)


def test_autotune_failing_candidate_is_skipped_and_remembered(tmp_path):
    clock = FakeClock({_key("TorchFake"): 0.5})
    cache = TimingCache(tmp_path / "t.json", DEVICE)
    sel = _select(clock, _cands(clock, raises=True), cache)
    assert sel.kernel == "TorchFake" and len(sel.failed) == 2
    assert "out of shared memory" in sel.failed[0]
    cache.save()
    again = FakeClock({_key("TorchFake"): 0.5})
    sel2 = _select(again, _cands(again, raises=True), TimingCache(tmp_path / "t.json", DEVICE))
    assert again.calls == 0 and sel2.cached == 3 and len(sel2.failed) == 2


def test_autotune_every_candidate_failing_is_an_error():
    clock = FakeClock({})
    with pytest.raises(RuntimeError, match="every candidate failed"):
        _select(clock, _cands(clock, raises=True)[:2])


def test_autotune_verify_rejects_wrong_outputs(monkeypatch):
    import kiln.builder.autotune as AT

    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.01, _key("TorchFake"): 0.5})
    cands = _cands(clock, tactics=({"B": 1},), out=torch.zeros(4, 8))
    monkeypatch.setattr(AT, "vendor_kernel", lambda op: cands[-1].kernel)
    sel = _select(clock, cands, verify=True)
    assert sel.kernel == "TorchFake"
    assert "differ" in sel.failed[0]


def test_autotune_cache_round_trip_skips_timing(tmp_path):
    path = tmp_path / "sub" / "timing.json"
    table = {_key("TritonFake", {"B": 1}): 0.3, _key("TritonFake", {"B": 2}): 0.1,
             _key("TorchFake"): 0.2}
    clock = FakeClock(table)
    cache = TimingCache(path, DEVICE)
    first = _select(clock, _cands(clock), cache)
    cache.save()
    d = json.loads(path.read_text())
    assert d["format"] == "kiln-timing-cache" and len(next(iter(d["entries"].values()))) == 3
    clock2 = FakeClock(table)
    cache2 = TimingCache(path, DEVICE)
    second = _select(clock2, _cands(clock2), cache2)
    assert clock2.calls == 0 and cache2.hits == 3 and second.cached == 3
    assert (second.kernel, second.tactic, second.ms) == (first.kernel, first.tactic, first.ms)


def test_autotune_cache_is_per_device_and_version(tmp_path):
    path = tmp_path / "timing.json"
    table = {_key("TritonFake", {"B": 1}): 0.3, _key("TritonFake", {"B": 2}): 0.1,
             _key("TorchFake"): 0.2}
    clock = FakeClock(table)
    cache = TimingCache(path, DEVICE)
    _select(clock, _cands(clock), cache)
    cache.save()
    other = FakeClock(table)
    _select(other, _cands(other), TimingCache(path, dict(DEVICE, triton="3.10")))
    assert other.calls == 3


def test_autotune_damaged_cache_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "timing.json"
    path.write_text("{not json")
    logged = []
    cache = TimingCache(path, DEVICE, log=logged.append)
    assert cache.entries == {} and "ignored" in logged[0]
    path.write_text(json.dumps({"format": "something-else", "version": 1, "entries": {}}))
    TimingCache(path, DEVICE, log=logged.append)
    assert "kiln-timing-cache" in logged[1]


def test_autotune_cache_without_path_never_writes(tmp_path):
    cache = TimingCache(None, DEVICE)
    cache.put("sig", 1.0)
    cache.save()
    assert cache.get("sig") == 1.0 and list(tmp_path.iterdir()) == []


def test_autotune_signature_separates_tactic_shape_dtype_and_attrs():
    a = OP.make_attrs()
    base = signature(OP, "K", {"B": 1}, a, (X,))
    assert base == signature(OP, "K", {"B": 1}, OP.make_attrs(), (torch.ones(4, 8),))
    assert base != signature(OP, "K", {"B": 2}, a, (X,))
    assert base != signature(OP, "K", {"B": 1}, a, (torch.ones(4, 9),))
    assert base != signature(OP, "K", {"B": 1}, a, (X.half(),))
    assert base != signature(OP, "K", {"B": 1}, OP.make_attrs(axis=0), (X,))
    assert base != signature(OP, "K2", {"B": 1}, a, (X,))


def test_autotune_candidates_respect_supports_and_tactic_space():
    op = OpDef("AutotuneCandOp")

    @register(op, backend="cuda", name="TritonA", tactics=lambda n, ins: [{"T": ins[0].dim()}])
    def a(n, x):
        return x

    @register(op, backend="cuda", name="TritonNever", tactics=({"T": 1},),
              supports=lambda n, ins: False)
    def never(n, x):
        return x

    @register(op, name="TorchCand")
    def vendor(n, x):
        return x

    cands = candidates(op, _call(), (X,))
    assert [(c.kernel.name, c.tactic) for c in cands] == [("TritonA", {"T": 2}),
                                                         ("TorchCand", None)]


def test_tuning_run_survives_inputs_the_model_cannot_take():
    """TopK's k, computed from an integer input, exceeds the axis: the tuning run stops
    there, the build goes on (those layers keep their default kernel) and says why."""
    from onnx import TensorProto, helper, numpy_helper

    from kiln.frontend import import_onnx

    nodes = [helper.make_node("Add", ["k", "big"], ["k9"], name="k_plus"),
             helper.make_node("TopK", ["x", "k9"], ["v", "i"], name="topk"),
             helper.make_node("Softmax", ["v"], ["p"], name="softmax")]  # has CUDA kernels
    g = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                     helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("i", TensorProto.INT64, None)],
        [numpy_helper.from_array(np.array([9], np.int64), "big")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    lines: list[str] = []
    status: dict = {}
    picks = autotune.tune_graph(import_onnx(model), None, None, timer=lambda fn: 1.0,
                                log=lines.append, device="cpu", status=status)
    assert picks == {} and status == {"complete": False}
    assert any("stopped on random inputs" in ln and "topk" in ln for ln in lines)


def _gather_model(rows: int, offset: int = 0):
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((rows, 4), np.float32), "table")
    nodes = [helper.make_node("Add", ["ids", "offset"], ["idx"], name="shift"),
             helper.make_node("Gather", ["table", "idx"], ["e"], name="embed"),
             helper.make_node("Softmax", ["e"], ["p"], name="softmax")]
    g = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("ids", TensorProto.INT64, [64])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, None)],
        [table, numpy_helper.from_array(np.array(offset, np.int64), "offset")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_tuning_run_feeds_valid_token_ids_and_checks_indices():
    """The tuning run feeds zero integers, so a 2-row table (a BERT's token types) is passed
    and the layers after it are tuned; an index computed past a table's end would be a
    device-side assert on CUDA, which no process survives, so Gather's indices are checked and
    the run stops with a KilnError instead."""
    from kiln.frontend import import_onnx

    lines: list[str] = []
    status: dict = {}
    autotune.tune_graph(import_onnx(_gather_model(2)), None, None, timer=lambda fn: 1.0,
                        log=lines.append, device="cpu", status=status)
    assert status == {"complete": True}
    autotune.tune_graph(import_onnx(_gather_model(3, offset=5)), None, None,
                        timer=lambda fn: 1.0, log=lines.append, device="cpu", status=status)
    assert status == {"complete": False}
    assert any("random indices outside [-3, 3)" in ln for ln in lines)


def test_tuning_skipped_without_cuda_kernels():
    from onnx import TensorProto, helper

    from kiln.frontend import import_onnx

    g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"], name="neg")], "m",
        [helper.make_tensor_value_info("x", TensorProto.STRING, [2])],  # no random data
        [helper.make_tensor_value_info("y", TensorProto.STRING, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    status: dict = {}
    assert autotune.tune_graph(import_onnx(model), None, None, timer=lambda fn: 1.0,
                               device="cpu", status=status) == {}
    assert status == {"complete": False}


def test_tuning_run_stops_at_class_indices_out_of_range():
    """NegativeLogLikelihoodLoss's targets (input + 7) overflow 5 classes: a CUDA device-side
    assert, so the tuning run stops first."""
    from onnx import TensorProto, helper, numpy_helper

    from kiln.frontend import import_onnx

    nodes = [helper.make_node("LogSoftmax", ["x"], ["lp"], name="lsm", axis=1),
             helper.make_node("Add", ["t", "seven"], ["t7"], name="shift"),
             helper.make_node("NegativeLogLikelihoodLoss", ["lp", "t7"], ["loss"], name="nll")]
    g = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5]),
                     helper.make_tensor_value_info("t", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(7, np.int64), "seven")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    lines: list[str] = []
    status: dict = {}
    autotune.tune_graph(import_onnx(model), None, None, timer=lambda fn: 1.0,
                        log=lines.append, device="cpu", status=status)
    assert status == {"complete": False}
    assert any("'nll': random indices outside [0, 5)" in ln for ln in lines)


class EstimatingClock(FakeClock):
    """A FakeClock whose ``estimate`` answers from its own table (the quick first pass)."""

    def __init__(self, table, estimates):
        super().__init__(table)
        self.estimates, self.estimated, self.full = estimates, [], []

    def __call__(self, fn):
        ms = super().__call__(fn)
        self.full.append(self.last)
        return ms

    def estimate(self, fn):
        fn()
        self.estimated.append(self.last)
        return self.estimates[self.last]


def test_autotune_prunes_to_the_fastest_estimates_and_the_vendor_kernel(tmp_path):
    tactics = [{"B": b} for b in range(6)]
    est = {_key("TritonFake", t): 0.1 * (t["B"] + 1) for t in tactics} | {_key("TorchFake"): 0.9}
    # in full, B=2 turns out faster than B=0; B=5 would have been fastest but its estimate
    # was the worst, so it is never timed in full and never chosen
    full = dict(est) | {_key("TritonFake", {"B": 2}): 0.05, _key("TritonFake", {"B": 5}): 0.01}
    clock = EstimatingClock(full, est)
    cache = TimingCache(tmp_path / "t.json", DEVICE)
    sel = select("n1", OP, _call(), (X,), _cands(clock, tactics), clock, cache, verify=False,
                 keep=3)
    assert len(clock.estimated) == 7
    assert sorted(clock.full) == sorted([_key("TritonFake", {"B": b}) for b in (0, 1, 2)]
                                        + [_key("TorchFake")])
    assert (sel.kernel, sel.tactic, sel.ms) == ("TritonFake", {"B": 2}, 0.05)
    assert sel.pruned == 3 and sel.timed == 7
    cache.save()
    again = EstimatingClock(full, est)
    sel2 = select("n1", OP, _call(), (X,), _cands(again, tactics), again,
                  TimingCache(tmp_path / "t.json", DEVICE), verify=False, keep=3)
    assert (sel2.kernel, sel2.tactic) == ("TritonFake", {"B": 2})
    assert sel2.cached == 7 and sel2.timed == 0 and not again.estimated and not again.full


def test_autotune_without_pruning_times_everything_in_full():
    tactics = [{"B": b} for b in range(6)]
    est = {_key("TritonFake", t): 0.1 * (t["B"] + 1) for t in tactics} | {_key("TorchFake"): 0.9}
    full = dict(est) | {_key("TritonFake", {"B": 5}): 0.01}
    clock = EstimatingClock(full, est)
    sel = select("n1", OP, _call(), (X,), _cands(clock, tactics), clock, verify=False, keep=0)
    assert not clock.estimated and len(clock.full) == 7
    assert sel.tactic == {"B": 5} and sel.pruned == 0


def test_autotune_pruning_keeps_the_fastest_plan_free_candidate():
    """Where the fastest estimates all make cuDNN plans, the fastest plan-free one is timed in
    full too, so plan_margin can still prefer it."""
    def plans(t):
        return bool(t) and t.get("B", 0) < 3  # B=0,1,2 make a plan; B=3,4 do not

    tactics = [{"B": b} for b in range(5)]
    est = {_key("TritonFake", t): 0.1 * (t["B"] + 1) for t in tactics} | {_key("TorchFake"): 0.9}
    clock = EstimatingClock(dict(est), est)
    k = dataclasses.replace(_kernel(clock, "TritonFake"), makes_plan=plans)
    cands = [Candidate(k, t) for t in tactics] + [Candidate(_kernel(clock, "TorchFake",
                                                                    backend="cpu"))]
    sel = select("n1", OP, _call(), (X,), cands, clock, verify=False, keep=3, plan_margin=3.0)
    assert _key("TritonFake", {"B": 3}) in clock.full
    assert _key("TritonFake", {"B": 4}) not in clock.full
    assert sel.tactic == {"B": 3} and sel.plan_free  # 0.4 ms is within 300% of 0.1 ms


def test_autotune_pruning_keeps_the_fastest_library_free_candidate_for_any_library():
    """Where the fastest estimates and the PyTorch kernel all use a CUDA library that makes no
    plan (SDPA, cuBLAS), the fastest library-free one is still timed in full, so the
    engine-wide rule has a library-free pick to switch to (``Selection.planless``)."""
    tactics = [{"B": b} for b in range(5)]
    est = {_key("TritonFake", t): 0.1 * (t["B"] + 1) for t in tactics} | {_key("TorchFake"): 0.9}
    clock = EstimatingClock(dict(est), est)
    k = dataclasses.replace(_kernel(clock, "TritonFake"),
                            makes_plan=lambda t: "sdpa" if t["B"] < 3 else None)
    torch_k = dataclasses.replace(_kernel(clock, "TorchFake", backend="cpu"),
                                  makes_plan=lambda t: "sdpa")
    cands = [Candidate(k, t) for t in tactics] + [Candidate(torch_k)]
    sel = select("n1", OP, _call(), (X,), cands, clock, verify=False, keep=3)
    assert _key("TritonFake", {"B": 3}) in clock.full
    assert _key("TritonFake", {"B": 4}) not in clock.full
    assert sel.tactic == {"B": 0} and sel.library == "sdpa"
    assert sel.planless[1:] == ("TritonFake", {"B": 3}, 0.4)


def test_no_tune_skips_timing_and_picks_the_pytorch_kernels(monkeypatch):
    """``tune=False`` (``kiln build --no-tune``) on CUDA times nothing and gives every layer
    the PyTorch kernel, never an untimed Triton one."""
    import torch
    from onnx import TensorProto, helper

    from kiln.builder import Builder, BuilderConfig
    from kiln.frontend import import_onnx
    from kiln.kernels.registry import kernels_for

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    graph = import_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lines: list[str] = []
    builder = Builder(BuilderConfig(device="cuda", tune=False), log=lines.append)
    assert builder._autotune(graph) is None
    assert any("autotune: off" in ln for ln in lines)
    choices, tactics = builder._choose_kernels(graph, None)
    node = next(iter(graph.nodes))
    assert choices == {"relu": kernels_for(node.op, "cpu")[0].name} and tactics == {}


def _two_softmax_model():
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Softmax", ["x"], ["p"], name="softmax_a"),
             helper.make_node("Relu", ["p"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["q"], name="softmax_b")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [2, 6])],
                          [helper.make_tensor_value_info("q", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_tuning_run_tunes_only_the_nodes_it_is_given():
    """``keep`` refusing every candidate of a layer: that layer runs untimed."""
    from kiln.frontend import import_onnx

    graph = import_onnx(_two_softmax_model())
    every = autotune.tune_graph(graph, None, None, timer=lambda fn: 1.0, device="cpu")
    assert set(every) == {"softmax_a", "softmax_b"}
    timed: list = []
    picks = autotune.tune_graph(graph, None, None, timer=lambda fn: timed.append(fn) or 1.0,
                                device="cpu", keep=lambda node, c, a: node == "softmax_b")
    assert set(picks) == {"softmax_b"} and len(timed) == picks["softmax_b"].timed


def test_precompile_workers_split_candidates_by_what_they_compile():
    """Each compiled candidate has exactly one owner; equal compiles (same kernel, tactic and
    attributes, other layers) have the same owner; PyTorch candidates go to none."""
    from kiln.builder import precompile
    from kiln.builder.autotune import Candidate
    from kiln.frontend import import_onnx
    from kiln.kernels.registry import Kernel

    k = Kernel(name="TritonX", op=None, backend="cuda", fn=lambda *a: None)
    torch_k = Kernel(name="TorchX", op=None, backend="cpu", fn=lambda *a: None)
    tactics = [{"BLOCK": b, "num_warps": w} for b in (64, 128, 256) for w in (2, 4, 8)]
    n = 3
    keeps = [precompile.keeps(i, n) for i in range(n)]
    for t in tactics:
        owners = [i for i in range(n) if keeps[i]("a", Candidate(k, t), {"axis": 1})]
        assert len(owners) == 1
        assert keeps[owners[0]]("another_layer", Candidate(k, dict(t)), {"axis": 1})
    assert not any(kp("a", Candidate(torch_k), {"axis": 1}) for kp in keeps)
    assert len({precompile.owner(k.name, t, {}, n) for t in tactics}) > 1  # spread out
    pytest.importorskip("triton")
    import kiln.kernels.triton  # noqa: F401  (registers the CUDA kernels tuned_layers counts)

    graph = import_onnx(_two_softmax_model())
    assert precompile.tuned_layers(graph) == ["softmax_a", "softmax_b"]


def test_tuning_run_keeps_only_the_candidates_it_is_given():
    """``keep`` (the workers' filter): the others are not run; a layer left with one
    candidate is still run once (a worker compiles it)."""
    from kiln.frontend import import_onnx

    graph = import_onnx(_two_softmax_model())
    every = autotune.tune_graph(graph, None, None, timer=lambda fn: 1.0, device="cpu")
    n_all = every["softmax_a"].timed
    assert n_all > 1
    first = {}

    def keep(node, cand, attrs):
        return first.setdefault(node, cand.label) == cand.label
    picks = autotune.tune_graph(graph, None, None, timer=lambda fn: 1.0, device="cpu",
                                keep=keep)
    assert set(picks) == {"softmax_a", "softmax_b"}
    assert all(s.timed == 1 for s in picks.values())


def test_builder_config_checks_compile_workers():
    from kiln.builder import BuilderConfig

    with pytest.raises(ValueError, match="compile_workers"):
        BuilderConfig(device="cuda", compile_workers=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_precompiled_build_picks_what_a_serial_build_picks(tmp_path, monkeypatch):
    """A CUDA build whose candidates two worker processes compiled first tunes the same
    layers and keeps valid outputs (the timing itself differs run to run)."""
    from kiln.builder import Builder, BuilderConfig

    path = tmp_path / "m.onnx"
    path.write_bytes(_two_softmax_model().SerializeToString())
    from kiln.builder import precompile

    monkeypatch.setattr(precompile, "MIN_LAYERS", 0)  # two layers: as a rule, too few
    b = Builder(BuilderConfig(device="cuda", compile_workers=2))
    engine = b.build(str(path))
    assert b.report["precompile"]["failed"] == []
    serial = Builder(BuilderConfig(device="cuda", compile_workers=0,
                                   timing_cache=str(tmp_path / "c.json")))
    serial.build(str(path))
    assert set(b.report["autotune"]) == set(serial.report["autotune"])
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    want = torch.softmax(torch.relu(torch.softmax(torch.from_numpy(x), -1)), -1).numpy()
    got = engine.create_context().run({"x": x})["q"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_drop_plans_per_library_cublas_switched_cudnn_kept():
    """Two libraries in one engine. n1's cuBLAS pick is 10% faster than its library-free
    tactic: the per-layer margin (cuDNN plans only) leaves it, the engine-wide rule switches it
    (saves 0.01 of ~0.2 ms). n2's cuDNN pick has no library-free candidate: cuDNN stays."""
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.10, _key("TritonFake", {"B": 2}): 0.11})
    k = Kernel(OP, "cuda", _kernel(clock, "TritonFake").fn, "TritonFake",
               makes_plan=lambda t: "cublas" if t["B"] == 1 else None)
    n1 = select("n1", OP, _call(), (X,), [Candidate(k, {"B": 1}), Candidate(k, {"B": 2})],
                clock, verify=False, plan_margin=0.25)
    assert (n1.tactic, n1.library, n1.plan_free) == ({"B": 1}, "cublas", False)
    clock2 = FakeClock({_key("TorchFake"): 0.09})
    torch_k = Kernel(OP, "cpu", _kernel(clock2, "TorchFake", backend="cpu").fn, "TorchFake",
                     makes_plan=lambda t: True)
    clock2.table[_key("TorchFake", None)] = 0.09
    n2 = select("n2", OP, _call(), (X,), [Candidate(torch_k), Candidate(torch_k)], clock2,
                verify=False, plan_margin=0.25)
    assert n2.library == "cudnn" and n2.planless is None
    got = autotune.drop_plans({"n1": n1, "n2": n2}, 0.25)
    assert [(lib, n, sw) for lib, n, _, sw in got] == [("cublas", 1, True), ("cudnn", 1, False)]
    assert (n1.tactic, n1.library, n1.ms) == ({"B": 2}, None, 0.11)
    assert n2.kernel == "TorchFake" and n2.library == "cudnn"


def test_drop_plans_keeps_a_library_untuned_layers_load():
    """A squeeze-excite's torch kernel (cuBLAS, no CUDA kernel to tune) loads cuBLAS anyway:
    the tuned cuBLAS layer keeps its faster pick; a library no untuned layer uses is dropped."""
    from types import SimpleNamespace

    from kiln.kernels.registry import cublas

    lib_op = OpDef("AutotuneLibTestOp", {})
    register(lib_op, name="TorchLibTest", makes_plan=cublas)(lambda call, x: x)
    plain_op = OpDef("AutotunePlainTestOp", {})
    register(plain_op, name="TorchPlainTest")(lambda call, x: x)

    def node(name, op):
        return SimpleNamespace(name=name, op=op, subgraphs=lambda: [])

    def picks():
        clock = FakeClock({_key("TritonFake", {"B": 1}): 0.10,
                           _key("TritonFake", {"B": 2}): 0.11})
        k = Kernel(OP, "cuda", _kernel(clock, "TritonFake").fn, "TritonFake",
                   makes_plan=lambda t: "cublas" if t["B"] == 1 else None)
        return {"n1": select("n1", OP, _call(), (X,), [Candidate(k, {"B": 1}),
                                                       Candidate(k, {"B": 2})], clock,
                             verify=False)}

    graph = SimpleNamespace(nodes=[node("n1", OP), node("se", lib_op), node("add", plain_op)])
    assert autotune.untuned_libraries(graph, picks()) == {"cublas"}
    p = picks()
    assert [r[3] for r in autotune.drop_plans(p, 0.25, {"cublas"})] == [False]
    assert p["n1"].tactic == {"B": 1}
    plain = SimpleNamespace(nodes=[node("n1", OP), node("add", plain_op)])
    assert autotune.untuned_libraries(plain, picks()) == set()
    p = picks()
    assert [r[3] for r in autotune.drop_plans(p, 0.25, set())] == [True]
    assert p["n1"].tactic == {"B": 2}


@pytest.mark.parametrize("payback,kept", [
    (0, "B=2"),      # the margin alone: 20% slower, within 25%, plan-free
    (1000, "B=2"),   # loses 0.002 ms x 1000 runs = 2 ms, less than the plan it spares
])
def test_autotune_plan_payback_small_layers_keep_the_plan_free_kernel(payback, kept):
    """A 0.1 ms layer whose plan-free tactic is 0.002 ms slower loses 2 ms over 1000 runs,
    less than the cuDNN plan it spares (PLAN_MS): the plan-free tactic either way."""
    clock = FakeClock({_key("TritonFake", {"B": 1}): 0.100,
                       _key("TritonFake", {"B": 2}): 0.102, _key("TorchFake"): 0.105})
    sel = select("n1", OP, _call(), (X,), _plan_cands(clock), clock, verify=False,
                 plan_margin=0.25, plan_payback=payback)
    assert sel.tactic == {"B": int(kept[-1])} and sel.plan_free


def test_autotune_plan_payback_large_layers_keep_the_fastest():
    """A 10 ms layer (a large batch) whose plan-free tactic is 20% slower loses 2 ms a run:
    within the 25% margin, but over 1000 runs far more than a cuDNN plan: the fastest stays;
    without payback (0) the margin alone keeps the plan-free one."""
    clock = FakeClock({_key("TritonFake", {"B": 1}): 10.0,
                       _key("TritonFake", {"B": 2}): 12.0, _key("TorchFake"): 10.5})
    sel = select("n1", OP, _call(), (X,), _plan_cands(clock), clock, verify=False,
                 plan_margin=0.25, plan_payback=1000)
    assert sel.tactic == {"B": 1} and not sel.plan_free and sel.library == "cudnn"
    sel0 = select("n1", OP, _call(), (X,), _plan_cands(clock), clock, verify=False,
                  plan_margin=0.25, plan_payback=0)
    assert sel0.tactic == {"B": 2} and sel0.plan_free


def test_drop_plans_payback_keeps_a_library_that_pays_for_itself():
    """cuDNN saves 0.05 of 1.10 ms a run (5%, under the 25% margin): switched with the margin
    alone or a short payback (0.05 x 1000 = 50 ms < cuDNN's start-up), kept when the engine is
    weighed over 100k runs (5 s > its start-up)."""
    assert [r[3] for r in autotune.drop_plans(_engine_picks(0.15), 0.25, payback=0)] == [True]
    assert [r[3] for r in autotune.drop_plans(_engine_picks(0.15), 0.25, payback=1000)] == [True]
    picks = _engine_picks(0.15)
    assert [r[3] for r in autotune.drop_plans(picks, 0.25, payback=100_000)] == [False]
    assert picks["n1"].library == "cudnn" and picks["n1"].tactic == {"B": 1}


def test_builder_config_rejects_a_negative_plan_payback():
    from kiln.builder import BuilderConfig
    with pytest.raises(ValueError, match="plan_payback"):
        BuilderConfig(device="cuda", plan_payback=-1)


def test_signature_ignores_calibrated_scales_but_not_their_use():
    """Two INT8 layers that differ only in their calibrated scales share a timing; a dynamic
    scale (0) or an output handed off as codes does not."""
    from kiln.ops import int8 as I8

    x = torch.zeros(4, 8)

    def sig(**kw):
        return autotune.signature(I8.Int8MatMul, "K", None, I8.Int8MatMul.make_attrs(**kw), [x])

    assert sig(x_scale=0.1, x_zero=100) == sig(x_scale=0.3, x_zero=90)
    assert sig(x_scale=0.1, out_scale=0.2) == sig(x_scale=0.5, out_scale=0.7)
    assert sig(x_scale=0.1) != sig(x_scale=0.0)
    assert sig(x_scale=0.1) != sig(x_scale=0.1, out_scale=0.2)
    assert sig(x_scale=0.1) != sig(x_scale=0.1, activation="Relu")
