import os
import threading

import pytest
import torch

# Triton reads this when its kernels are decorated: set it before any test imports them. With
# a GPU the same small-shape tests run compiled on CUDA; without one, under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


@pytest.fixture
def fresh(monkeypatch):
    """The CPU linear's and convolution's clean process-wide choice table, the tactics on,
    nothing pinned (a test pins one by setting ``_FORCED`` or ``_FORCED_CONV`` on the returned
    monkeypatch), every shape timed (no nearby shape's pick reused), and every GEMM timed
    (the small ones the tests use included: KILN_BELOW and KILN_FEW_ROWS_BELOW 0;
    test_cpu_linear.py tests the untimed pick itself)."""
    from kiln.kernels.torch import fused_conv as FCK

    monkeypatch.setattr(FCK, "_choices", {})
    monkeypatch.setattr(FCK, "PACKED_LINEAR", True)
    monkeypatch.setattr(FCK, "_FORCED", "")
    monkeypatch.setattr(FCK, "_FORCED_CONV", "")
    monkeypatch.setattr(FCK, "KILN_BELOW", 0)
    monkeypatch.setattr(FCK, "KILN_FEW_ROWS_BELOW", 0)
    monkeypatch.setattr(FCK, "NEAREST_WITHIN", 1.0)  # every shape timed (tested on its own)
    return monkeypatch


@pytest.fixture
def concurrently():
    """``run(work, n)``: ``work(i)`` for i in range(n), on n threads released together by a
    barrier (so they race); returns when all are done. A thread's exception is not raised
    here: tests check what each ``work`` stored."""
    def run(work, n):
        start = threading.Barrier(n)

        def body(i):
            start.wait()
            work(i)

        threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


@pytest.fixture(params=["avx2", "avx512"])
def conv_isa(request):
    """Each instruction set of the float GEMM, direct conv and depthwise conv kernels
    (kiln.native.set_conv_isa): the AVX2 path runs on an AVX-512 machine too, the AVX-512 one
    where the CPU has it (skipped elsewhere). The best one is restored afterwards."""
    from kiln import native

    if not native.available:
        pytest.skip(native.why_not or "no kiln.native")
    if request.param not in native.conv_isas():
        pytest.skip(f"this CPU has no {request.param}")
    assert native.set_conv_isa(request.param) == request.param
    yield request.param
    native.set_conv_isa(None)
