"""kiln's thread team (kiln/native/team.c) under its kernels: the same result on any number of
threads (every output element is computed by one thread the same way), calls from several
Python threads at once (one runs on the team, the others alone), and a forked child, which has
no workers (its caller does every chunk)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kiln import native

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")


def _gemm_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(301, 96, generator=g)
    w = native.PackedWeight(torch.randn(96, 200, generator=g))
    return x, w, torch.randn(200, generator=g)


def _depthwise_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 37, 40, generator=g)  # NHWC, 40 channels: 5 blocks a row
    run = native.depthwise_fn(native.DepthwiseWeight(torch.randn(40, 1, 3, 3, generator=g)),
                              (1, 1), (1, 1), torch.randn(40, generator=g), "Relu")
    return lambda: run(x, (1, 1), None, torch.empty(2, 9, 37, 40))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("n", [2, 3, 5])
def test_team_results_do_not_depend_on_threads(threads, n):
    x, w, b = _gemm_case()
    dw = _depthwise_case()
    threads(1)
    want_gemm, want_dw = native.gemm(x, w, b, activation="Relu"), dw()
    big = torch.randn(300, 257)
    want_pw = native.pointwise("Sigmoid", big)
    threads(n)
    for k in range(4):  # the first call starts the workers, the others find them awake
        assert torch.equal(native.gemm(x, w, b, activation="Relu"), want_gemm)
        assert torch.equal(dw(), want_dw)
        if k == 2:
            native.team_rest()  # asleep at once: the next call wakes them
        assert torch.equal(native.pointwise("Sigmoid", big), want_pw)


@needs_native
def test_team_callers_on_several_threads(threads):
    threads(2)
    x, w, b = _gemm_case()
    want = native.gemm(x, w, b)
    got, errors = [], []

    def call():
        try:
            for _ in range(20):
                got.append(torch.equal(native.gemm(x, w, b), want))
        except Exception as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=call) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and len(got) == 60 and all(got)


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_team_in_a_forked_child(threads):
    threads(2)
    run = _depthwise_case()
    want = run()  # the parent's workers are started
    pid = os.fork()
    if pid == 0:  # the child: no workers; it must neither hang nor compute wrong
        ok = all(torch.equal(run(), want) for _ in range(3))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
