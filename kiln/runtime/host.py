"""Host memory for CPU engines: keep freed activation memory in the process for reuse.

PyTorch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold (128
KiB at first, raised up to 32 MiB as such blocks are freed) with fresh ``mmap``s and hands the
top of the heap back to the OS past its trim threshold. Either way, an activation of the next
run lands on pages the kernel must fault in again: ResNet-50 at batch 8 took ~20,600 page faults
a run on this project's CPU machine, with its 585 ms dropping to 535 ms without them.
onnxruntime avoids this with its own memory arena. kiln keeps glibc's freed memory instead:
``mallopt`` with the largest mmap threshold glibc takes (32 MiB on 64-bit) and no trimming, set
once per process when the first CPU execution context is made. A tensor above 32 MiB still
gets its own ``mmap``.

The cost is that the process keeps the peak of its heap (what the largest run needed) instead
of returning it between runs, as an arena does. ``KILN_CPU_KEEP_MEMORY=0`` leaves malloc as it
is. Elsewhere than glibc (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from kiln.settings import SETTINGS

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's upper limit
_lock = threading.Lock()
_done: bool | None = None  # None: not tried yet; then whether glibc took the settings


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory (see the module docstring), once per process. Returns
    whether the settings are in effect."""
    global _done
    with _lock:
        if _done is None:
            _done = SETTINGS.cpu_keep_memory and _mallopt()
        return _done


def _mallopt() -> bool:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: other parameters
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # a fixed mmap threshold (which also stops glibc adjusting it), and no trim: both return 1
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
            and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1)
