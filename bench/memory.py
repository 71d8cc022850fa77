"""Peak memory of one system's setup + run.

CPU: the process's peak resident set (VmHWM in /proc/self/status) is reset through
/proc/self/clear_refs before the system is set up, so afterwards VmHWM - VmRSS(before) is the
peak RSS growth, at no cost to timing. Where the reset is refused, a background thread samples
VmRSS every 5 ms instead. CUDA: torch.cuda.max_memory_allocated() minus memory_allocated()
before, after torch.cuda.reset_peak_memory_stats() (only memory from torch's allocator).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time

CPU_METHOD = ("peak RSS growth: VmHWM after the system's setup + run minus VmRSS before it "
              "(VmHWM reset through /proc/self/clear_refs; sampled VmRSS every 5 ms if the "
              "reset is refused); freed memory is returned to the OS (malloc_trim) between systems")
CUDA_METHOD = ("torch.cuda.max_memory_allocated() during setup + run minus memory_allocated() "
               "before (torch's caching allocator only; onnxruntime's CUDA memory is not seen)")


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
    """``with PeakMemory(device) as m: ...`` then ``m.peak_mib`` (None when unknown)."""

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
