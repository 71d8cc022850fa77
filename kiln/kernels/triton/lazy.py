"""``@jit`` kernels that import Triton only when one is first compiled.

``import triton`` costs a fresh process ~0.2 s, most of a CUDA engine's cold start, and a
CUDA engine built on this machine never needs it: its kernels travel in the file as cubins
(:mod:`kiln.kernels.triton.binary`) and launch through the CUDA driver. So kiln's kernels are
decorated with :func:`jit` from here, which keeps the Python function and computes what a call
key needs (:func:`kernel_info`) from its source and signature alone; the real ``triton.jit``
function is made the first time the kernel is launched through Triton, compiled or interpreted.

Triton resolves a kernel's globals (``tl``, the ``@jit`` helpers it calls) from its module's
globals when it compiles, and accepts only modules, ``JITFunction``\\ s and constexprs there; so
materializing a kernel also rebinds, in its module's globals, :data:`tl` to the real
``triton.language`` and every lazy kernel to its materialized function (helpers imported from
another module materialize with theirs). So a kernel calls a helper by a name of its own
module (``from kiln.kernels.triton.common import act``), never as ``common.act``. Kernel
modules use ``from __future__ import annotations`` so that ``x: tl.constexpr`` stays a string,
which Triton reads as a constexpr.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import re
import textwrap
import threading

_LOCK = threading.RLock()  # reentrant: materializing a kernel materializes its helpers


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for the host code: ceil(a / b)."""
    return (a + b - 1) // b


@functools.cache
def version() -> str | None:
    """The installed Triton's version, read from its package metadata (no import)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


class LazyModule:
    """A module's stand-in in a kernel module's globals until a kernel there materializes;
    host code that reaches through it imports the module (a cost, so kiln's host code does
    not)."""

    def __init__(self, name: str):
        self._name = name

    def load(self):
        return importlib.import_module(self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name}>"


tl = LazyModule("triton.language")


def kernel_info(fn) -> tuple:
    """(kernel id, parameter names, constexpr flags) of a kernel's Python function: the id is
    its name and a digest of its source from ``def`` on (what Triton's ``JITFunction.src``
    holds), so a kernel has one id whether or not it has been materialized."""
    src = textwrap.dedent(inspect.getsource(fn))
    src = src[re.search(r"^def\s+\w+\s*\(", src, re.MULTILINE).start():]
    params = inspect.signature(fn).parameters.values()
    kid = f"{fn.__name__}:{hashlib.sha1(src.encode()).hexdigest()[:16]}"
    return kid, tuple(p.name for p in params), tuple(
        p.annotation is not inspect.Parameter.empty and "constexpr" in str(p.annotation)
        for p in params)


class LazyJIT:
    """A ``@triton.jit`` function not made yet: ``kernel[grid](...)``, a device-function call
    (the interpreter's) and any public attribute of the JITFunction make it first."""

    def __init__(self, fn, options: dict):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self._real = None  # the JITFunction (InterpretedFunction under TRITON_INTERPRET=1)
        self._ready = None  # _real, once its module's globals are rebound too

    @functools.cached_property
    def _kiln_info(self) -> tuple:  # what binary.call_key reads; the JITFunction gets a copy
        return kernel_info(self.fn)

    def materialize(self):
        ready = self._ready
        if ready is not None:
            return ready
        with _LOCK:
            if self._real is None:
                import triton

                real = triton.jit(self.fn, **self.options)
                real._kiln_info = self._kiln_info
                self._real = real  # before rebinding: a helper may lead back here
                _bind_globals(self.fn.__globals__)
                self._ready = real
            return self._real

    def __getitem__(self, grid):
        return self.materialize()[grid]

    def __call__(self, *args, **kwargs):
        return self.materialize()(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"<lazy jit {self.__module__}.{self.__qualname__}>"


def jit(fn=None, **options):
    """``triton.jit`` (same options), made on first use: see the module docstring."""
    if fn is None:
        return lambda f: LazyJIT(f, options)
    return LazyJIT(fn, options)


def _bind_globals(g: dict) -> None:
    """Give Triton the globals it accepts: real modules, materialized kernels."""
    for name, value in list(g.items()):
        if isinstance(value, LazyJIT):
            g[name] = value.materialize()
        elif isinstance(value, LazyModule):
            g[name] = value.load()
