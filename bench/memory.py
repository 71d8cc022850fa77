"""Peak memory of one step of a system: its build (kiln), or its loading + runs (every system).

bench.run measures each system in two separate windows. The *inference* window (the table's
"peak mem MiB") opens just before the system is set up and closes after its timed runs: kiln
loads its engine file, creates a context and runs (the check run captures its CUDA graph); the
torch peers make their module (FP16 weights converted on the host), move it to the device and
run; onnxruntime creates its session (which includes its graph optimizations) and runs. kiln's
build (ONNX import, optimization, precision lowering, autotuning on the device) and the engine
file's save are an offline step: they get a window of their own ("build peak MiB"), closed
before the inference window opens, so what the build leaves allocated is in the latter's
baseline, not in its peak.

CPU: the process's peak resident set (VmHWM in /proc/self/status) is reset through
/proc/self/clear_refs when a window opens, so afterwards VmHWM - VmRSS(before) is the peak RSS
growth, at no cost to timing. Where the reset is refused, a background thread samples VmRSS every
5 ms instead. CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before, after
torch.cuda.reset_peak_memory_stats() (only memory from torch's allocator, and only memory handed
out: what the caching allocator holds in reserve, CUDA-graph pools' free blocks included, is not
counted).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time

CPU_METHOD = ("peak mem MiB, the inference peak: peak RSS growth over loading the system and "
              "running it (kiln: load the engine file + create a context + runs; torch: build "
              "the module (torch.compile: + compile) + runs; onnxruntime: session creation + "
              "runs), VmHWM at the end minus VmRSS before (VmHWM reset through "
              "/proc/self/clear_refs; sampled VmRSS every 5 ms if the reset is refused); build "
              "peak MiB (kiln only; '-' for the others): the same over building the engine from "
              "the ONNX file and saving it, an offline step measured before and apart from the "
              "inference peak; freed memory is returned to the OS (malloc_trim) before each "
              "window")
CUDA_METHOD = ("peak mem MiB, the inference peak: torch.cuda.max_memory_allocated() minus "
               "memory_allocated() before, over loading the system and running it (kiln: load "
               "the engine file + create a context + the first run, which captures the CUDA "
               "graph, + the timed runs; torch: the module's weights (FP16 ones converted on the "
               "host) moved to the device (torch.compile: + compile) + runs; onnxruntime: "
               "session creation + runs); build peak MiB (kiln only; '-' for the others): the "
               "same over building the engine (import, optimization, precision lowering, "
               "autotuning on the device) and saving it, an offline step measured before and "
               "apart from the inference peak. torch's caching allocator only: memory it holds "
               "in reserve (CUDA-graph pools included) is not counted, and onnxruntime's CUDA "
               "memory is not seen")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def release() -> None:
    """Collect garbage and give freed heap back to the OS, so one system's leftovers neither
    count against the next nor hide its growth."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_mib`` (None when unknown): the peak
    growth over the block. Windows do not nest (on CUDA each one resets the peak statistics)."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.peak_mib: float | None = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._max_kib = 0

    def __enter__(self):
        release()
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        self._base = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max_kib = max(self._max_kib, _status_kib("VmRSS"))
            time.sleep(0.005)

    def __exit__(self, *exc):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self.peak_mib = (torch.cuda.max_memory_allocated() - self._base) / 2**20
            return False
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            peak = self._max_kib
        else:
            peak = _status_kib("VmHWM")
        self.peak_mib = max(0, peak - self._base) / 1024
        return False
