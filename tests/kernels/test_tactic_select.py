"""The CPU tactic pick (``fused_conv._select``) on a fake clock: each candidate "takes" the
times a script gives it, so the logic (warm-up runs untimed, interleaving in alternating order,
the fastest run counting, credits, ties, dropping a wrong candidate, the round counts) is
checked without timing anything."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.torch import fused_conv as FCK


class FakeClock:
    """A clock that only moves when a candidate runs: ``tick(seconds)``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, s: float) -> None:
        self.now += s


def _candidates(clock, times: dict, log: list, wrong=()):
    """name -> fn; the k-th call of ``name`` takes ``times[name][k]`` seconds (the last value
    repeats), returns x (or x + 1 for a name in ``wrong``) and is logged."""
    calls = dict.fromkeys(times, 0)

    def make(name):
        def fn(x, r):
            seq = times[name]
            clock.tick(seq[min(calls[name], len(seq) - 1)])
            calls[name] += 1
            log.append(name)
            return x + 1 if name in wrong else x.clone()
        return fn
    return {name: make(name) for name in times}, calls


X = torch.ones(4, 4)


def test_fastest_run_counts_and_first_two_runs_are_not_timed():
    clock, log = FakeClock(), []
    # a: slow first call (setup) and slow second (warm-up), then 1.0 ms with one 0.5 ms run;
    # b: steady 0.8 ms. a's fastest timed run wins
    fns, _ = _candidates(clock, {"onednn": [1e-1, 1e-1, 1e-3, 1e-3, 5e-4, 1e-3],
                                 "kiln": [8e-4]}, log)
    name, y = FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    assert name == "onednn" and torch.equal(y, X)


def test_first_call_setup_alone_does_not_decide():
    clock, log = FakeClock(), []
    # kiln's first call is cheap, oneDNN's slow (primitive creation); afterwards oneDNN is
    # faster on every run: the first runs do not count
    fns, _ = _candidates(clock, {"onednn": [5e-2, 5e-2, 2e-4], "kiln": [1e-4, 3e-4]}, log)
    assert FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)[0] == "onednn"


def test_rounds_interleave_in_alternating_order():
    clock, log = FakeClock(), []
    fns, _ = _candidates(clock, {"onednn": [1e-3], "kiln": [1e-3], "kiln_direct": [1e-3]}, log)
    FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    timed = log[6:]  # after the checked run and the warm-up run of each
    rounds = [timed[i:i + 3] for i in range(0, len(timed) - 1, 3)]
    assert rounds[0] == ["onednn", "kiln", "kiln_direct"]
    assert rounds[1] == ["kiln_direct", "kiln", "onednn"]
    assert len(rounds) >= FCK._MIN_ROUNDS


def test_round_count_follows_the_budget(monkeypatch):
    monkeypatch.setattr(FCK, "_TIME_BUDGET_S", 0.01)
    clock, log = FakeClock(), []
    fns, calls = _candidates(clock, {"onednn": [1e-3], "kiln": [2e-3]}, log)
    FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    assert calls == {"onednn": 2 + 5, "kiln": 2 + 5}  # 0.01 s / 2 ms slowest: 5 rounds
    clock, log = FakeClock(), []
    fns, calls = _candidates(clock, {"onednn": [1e-7], "kiln": [1e-7]}, log)
    FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    assert calls["kiln"] == 2 + FCK._MAX_ROUNDS
    clock, log = FakeClock(), []
    fns, calls = _candidates(clock, {"onednn": [9e-3], "kiln": [9e-3]}, log)
    FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    assert calls["kiln"] == 2 + FCK._MIN_ROUNDS


def test_slower_than_the_budget_is_timed_by_its_first_run(monkeypatch):
    monkeypatch.setattr(FCK, "_TIME_BUDGET_S", 0.01)
    clock, log = FakeClock(), []
    fns, calls = _candidates(clock, {"onednn": [5e-2], "kiln": [3e-2]}, log)
    name, _ = FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    assert name == "kiln" and calls == {"onednn": 1, "kiln": 2}  # (kiln's output: a rerun)


def test_credit_and_tie():
    clock, log = FakeClock(), []
    fns, _ = _candidates(clock, {"onednn": [1.0e-4], "kiln": [1.04e-4]}, log)
    assert FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)[0] == "onednn"
    clock, log = FakeClock(), []
    fns, _ = _candidates(clock, {"onednn": [1.0e-4], "kiln": [1.04e-4]}, log)
    assert FCK._select(fns, X, None, FCK.CONV_TACTICS, {"kiln": 5e-6},
                       clock=clock)[0] == "kiln"
    clock, log = FakeClock(), []
    fns, _ = _candidates(clock, {"kiln": [1e-4], "onednn": [1e-4]}, log)
    assert FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)[0] == "onednn"  # order


@pytest.mark.parametrize("wrong", ["kiln", "kiln_direct"])
def test_a_candidate_off_the_reference_is_dropped(wrong):
    clock, log = FakeClock(), []
    fns, calls = _candidates(clock, {"onednn": [1e-3], "kiln": [1e-5], "kiln_direct": [1e-5]},
                             log, wrong=(wrong,))
    name, y = FCK._select(fns, X, None, FCK.CONV_TACTICS, clock=clock)
    assert name != wrong and calls[wrong] == 1 and torch.equal(y, X)
