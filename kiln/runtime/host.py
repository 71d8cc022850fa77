"""Host memory for CPU engines: keep freed activation memory in the process for reuse, and give
back the pages of engine-file weights that kernels have packed into their own layout.

PyTorch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold (128
KiB at first, raised up to 32 MiB as such blocks are freed) with fresh ``mmap``s and hands the
top of the heap back to the OS past its trim threshold. Either way, an activation of the next
run lands on pages the kernel must fault in again: ResNet-50 at batch 8 took ~20,600 page faults
a run on this project's CPU machine, with its 585 ms dropping to 535 ms without them.
onnxruntime avoids this with its own memory arena. kiln keeps glibc's freed memory instead:
``mallopt`` with no ``mmap``-served blocks at all and no trimming, set once per process when the
first CPU execution context is made. An earlier version only raised the mmap threshold to its
largest value (32 MiB on 64-bit), so larger tensors still got their own ``mmap``: GPT-2's 206 MB
of logits at batch 8 were faulted in afresh on every run. With every block from the heap, that
run takes 0.93x the time (paired engines).

The cost is that the process keeps the peak of its heap (what the largest run needed) instead
of returning it between runs, as an arena does. ``KILN_CPU_KEEP_MEMORY=0`` leaves malloc as it
is. Elsewhere than glibc (macOS, musl) this does nothing.

An engine's weights are views of its memory-mapped file (``kiln.engine.format``), and loading
reads all of it (the checksum), so every weight's pages are resident. A GEMM or conv weight that
a CPU kernel has packed into oneDNN's or MKL's layout is not read again, yet its pages would stay
resident for the engine's life: :func:`release_pages` hands them back (``madvise`` with
``MADV_DONTNEED``; a later read faults them in again from the file, unchanged). Only ranges of
file mappings registered with :func:`register_file_mapping` are touched, never other memory.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import threading

from kiln.settings import SETTINGS

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
MADV_DONTNEED = 4  # Linux
_lock = threading.Lock()
_done: bool | None = None  # None: not tried yet; then whether glibc took the settings
_mappings: list[tuple[int, int]] = []  # sorted (start, end) addresses of engine-file mappings


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory (see the module docstring), once per process. Returns
    whether the settings are in effect."""
    global _done
    with _lock:
        if _done is None:
            _done = SETTINGS.cpu_keep_memory and _mallopt()
        return _done


@functools.cache
def _libc():
    """The C library, or None where ctypes cannot load it."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


def _mallopt() -> bool:
    libc = _libc()
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # musl and others differ
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # every block from the heap (none mmap-served), and no trim: both return 1
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


@functools.cache
def _madvise():
    """libc's ``madvise``, typed, or None where there is none."""
    fn = getattr(_libc(), "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def register_file_mapping(start: int, length: int) -> None:
    """``[start, start + length)`` is a private mapping of an engine file, never written:
    :func:`release_pages` may drop its pages."""
    with _lock:
        bisect.insort(_mappings, (start, start + length))


def unregister_file_mapping(start: int) -> None:
    with _lock:
        _mappings[:] = [m for m in _mappings if m[0] != start]


def release_pages(t) -> int:
    """Drop the resident pages wholly inside CPU tensor ``t``'s memory when that memory lies in
    a registered engine-file mapping; returns the bytes released (0 when it is not one)."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or t.numel() == 0:
        return 0
    if any(st < 0 for st in t.stride()):
        return 0
    lo = t.data_ptr()  # with no negative strides, the lowest address; then t's whole extent
    hi = lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    with _lock:
        k = bisect.bisect_right(_mappings, (lo, float("inf"))) - 1
        if k < 0 or not (_mappings[k][0] <= lo and hi <= _mappings[k][1]):
            return 0
    page = mmap.PAGESIZE
    first, last = -(-lo // page) * page, hi // page * page  # whole pages inside t only
    if last <= first or madvise(first, last - first, MADV_DONTNEED) != 0:
        return 0
    return last - first

