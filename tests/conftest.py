import os

import pytest

import kiln  # noqa: F401  # isort: skip  (before torch: it sets OpenMP's wait policy)
import torch  # isort: skip

# Triton reads this when its kernels are decorated, i.e. when kiln.kernels.triton is first
# imported, which a test module may do at collection: set it here, before any of them. With a
# GPU the Triton tests run compiled on CUDA; without one, under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "conformance: ONNX backend node test cases")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_terminal_summary(terminalreporter):
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in counts:
        for rep in terminalreporter.stats.get(outcome, []):
            if "test_onnx_node[" in rep.nodeid and (rep.when == "call" or outcome == "skipped"):
                counts[outcome] += 1
    total = sum(counts.values())
    if total:
        terminalreporter.write_line(
            f"ONNX node conformance: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped of {total} run "
            f"({100.0 * counts['passed'] / total:.1f}% passing)")


@pytest.fixture(autouse=True)
def _fresh_process_timing_cache():
    """Builds without a timing-cache file share the process's times (autotune.TimingCache):
    tests with fake clocks must not see each other's."""
    from kiln.builder import autotune

    autotune._PROCESS_TIMES.clear()
    yield
    autotune._PROCESS_TIMES.clear()
