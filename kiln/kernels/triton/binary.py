"""Embedded Triton binaries: the kernels an engine was built with travel in its file.

Every kiln Triton kernel is launched through :func:`launch`. It has two ways to run a call:

- **Triton's JIT** (``kernel[grid](...)``): specializes, compiles (or finds the kernel in
  Triton's cache) and launches. At build time, with a :class:`Recorder` active, the compiled
  kernel it returns is recorded: cubin, entry name, warps, shared memory and which arguments the
  compiled code still takes (constexprs and arguments Triton specialized to a constant are
  compiled in).
- **An embedded binary**: at load, a CUDA engine whose GPU model and CUDA/torch/triton versions
  match the build machine's (:func:`kiln.runtime.cuda.check_device`) installs its binaries in a
  process-wide table. A call whose key is in the table is launched straight through the CUDA
  driver (``cuModuleLoadData`` once per device, then ``cuLaunchKernel``): no Triton JIT, no
  compiler, no disk cache, none of the ~0.5 s Triton spends setting itself up in a process.

The key of a call is computed by kiln from the call itself, and is at least as fine as
Triton's own specialization, so one key never stands for two different binaries: the kernel's
name and source digest, the value of every constexpr and launch option (``num_warps``, ...),
and for each runtime argument what Triton specializes on (a tensor's dtype and 16-byte
alignment; an integer's width, whether it is 1 and whether it divides by 16; bools by value;
floats as a type). A call with no binary (a shape that specializes differently from the ones
recorded, an engine from another machine loaded with ``portable=True``) goes through the JIT.

The argument-passing convention (each non-constexpr argument, then the global and profile
scratch pointers) is Triton's launcher's; it is checked for the Triton versions in
:data:`LAUNCH_ABI`, and binaries are neither recorded nor installed under any other version.
Kernels that need scratch memory, clusters, PDL or cooperative launch are never embedded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kiln.kernels.triton import lazy

# Triton versions (major.minor) whose NVIDIA launcher passes each non-constexpr argument and
# then two scratch pointers (global, profile): checked against triton 3.6's launcher source
LAUNCH_ABI = {"3.6": "args+2scratch"}

_TABLE: dict[str, Binary] = {}  # key -> binary, for installed engines (process-wide)
_TABLE_LOCK = threading.Lock()
_RECORDER: Recorder | None = None


def triton_abi() -> str | None:
    """The launch convention of the installed Triton, or None when kiln does not know it (read
    from the package's metadata: loading an engine imports no Triton)."""
    v = lazy.version()
    return None if v is None else LAUNCH_ABI.get(".".join(v.split(".")[:2]))


@functools.cache
def kernels_digest() -> str:
    """A digest of kiln's Triton kernel sources (this package), so binaries built from other
    sources are never used. Read once per process: every save and load asks for it."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------- keys


def _info(kernel) -> tuple:
    """(kernel id, parameter names, constexpr flags) of a kernel (:func:`lazy.kernel_info`): a
    lazy kernel and the JITFunction it materializes into carry the same tuple."""
    info = getattr(kernel, "_kiln_info", None)
    if info is None:  # a plain triton.jit function (or the interpreter's stand-in)
        info = kernel._kiln_info = lazy.kernel_info(kernel.fn)
    return info


def _spec(x):
    """What Triton specializes a runtime argument on (a little finer, never coarser)."""
    if isinstance(x, torch.Tensor):
        return ("T", str(x.dtype), x.data_ptr() % 16 == 0)
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        width = 32 if -2**31 <= x < 2**31 else (64 if -2**63 <= x < 2**63 else 65)
        return ("I", width, x == 1, x % 16 == 0)
    if isinstance(x, float):
        return "F"
    return ("?", repr(x))  # anything else: by value


def call_key(kernel, args: tuple, kwargs: dict) -> str:
    """The key of one call of ``kernel`` (see the module docstring)."""
    kid, names, constexpr = _info(kernel)
    parts = [kid]
    for i, a in enumerate(args):
        parts.append(repr(a) if i < len(constexpr) and constexpr[i] else _spec(a))
    for k in sorted(kwargs):
        v = kwargs[k]
        i = names.index(k) if k in names else -1
        parts.append((k, repr(v) if i < 0 or constexpr[i] else _spec(v)))
    return repr(tuple(parts))


# ---------------------------------------------------------------- the launch shim


def launch(kernel, grid, *args, **kwargs):
    """Launch ``kernel`` on ``grid``: through an installed binary when one matches the call,
    else through Triton's JIT (recording the compiled kernel while a Recorder is active)."""
    if _TABLE:
        b = _TABLE.get(call_key(kernel, args, kwargs))
        if b is not None:
            return b.launch(kernel, grid, args, kwargs)
    compiled = kernel[grid](*args, **kwargs)
    rec = _RECORDER
    if rec is not None and compiled is not None:
        rec.add(call_key(kernel, args, kwargs), compiled)
    return compiled


# ---------------------------------------------------------------- recording


class Recorder:
    """``with Recorder() as rec: <run the engine>`` collects the compiled kernels launched;
    ``rec.entries`` (key -> :class:`Binary`) and ``rec.skipped`` (why a kernel was not)."""

    def __init__(self):
        self.entries: dict[str, Binary] = {}
        self.skipped: dict[str, str] = {}

    def __enter__(self) -> Recorder:
        global _RECORDER
        _RECORDER = self
        return self

    def __exit__(self, *exc) -> None:
        global _RECORDER
        _RECORDER = None

    def add(self, key: str, compiled) -> None:
        if key in self.entries or key in self.skipped:
            return
        why = _unembeddable(compiled)
        if why:
            self.skipped[key] = why
            return
        md = compiled.metadata
        self.entries[key] = Binary(
            name=md.name, cubin=bytes(compiled.asm["cubin"]), num_warps=int(md.num_warps),
            shared=int(md.shared),
            args=[(str(n), str(t)) for n, t in compiled.src.signature.items()])


def _unembeddable(compiled) -> str | None:
    md = compiled.metadata
    if triton_abi() is None:
        return "Triton version without a known launch convention"
    if "cubin" not in compiled.asm:
        return "no cubin"
    if getattr(md, "num_ctas", 1) != 1:
        return "thread-block clusters"
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return "needs scratch memory"
    if getattr(md, "launch_pdl", False) or getattr(md, "launch_cooperative_grid", False):
        return "PDL or cooperative launch"
    for t in compiled.src.signature.values():
        if not isinstance(t, str) or not (t == "constexpr" or t.startswith("*") or t in _CTYPES):
            return f"argument type {t!r}"
    return None


# ---------------------------------------------------------------- one binary

_CTYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16,
           "i32": ctypes.c_int32, "i64": ctypes.c_int64, "u1": ctypes.c_uint8,
           "u8": ctypes.c_uint8, "u16": ctypes.c_uint16, "u32": ctypes.c_uint32,
           "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float,
           "fp64": ctypes.c_double}


@dataclass
class Binary:
    """One compiled kernel: what it takes and how to launch it."""

    name: str
    cubin: bytes
    num_warps: int
    shared: int
    args: list[tuple[str, str]]  # (parameter name, Triton type) in parameter order
    functions: dict[int, int] = field(default_factory=dict, repr=False)  # device -> CUfunction

    def to_json(self, tensor: str) -> dict:
        return {"name": self.name, "num_warps": self.num_warps, "shared": self.shared,
                "args": [list(a) for a in self.args], "tensor": tensor}

    @classmethod
    def from_json(cls, d: dict, cubin: bytes) -> Binary:
        return cls(name=str(d["name"]), cubin=cubin, num_warps=int(d["num_warps"]),
                   shared=int(d["shared"]), args=[(str(n), str(t)) for n, t in d["args"]])

    def function(self, device: int) -> int:
        f = self.functions.get(device)
        if f is None:
            with _TABLE_LOCK:
                f = self.functions.get(device)
                if f is None:
                    f = self.functions[device] = _driver().load(self.cubin, self.name,
                                                                self.shared, device)
        return f

    def launch(self, kernel, grid, args: tuple, kwargs: dict):
        names = _info(kernel)[1]
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if callable(grid):
            grid = grid(bound)
        g = tuple(int(v) for v in grid) + (1, 1)
        if g[0] * g[1] * g[2] == 0:
            return None
        keep = []
        for name, ty in self.args:
            if ty == "constexpr":
                continue
            v = bound[name]
            keep.append(ctypes.c_uint64(v.data_ptr()) if ty.startswith("*")
                        else _CTYPES[ty](v))
        keep += [ctypes.c_uint64(0), ctypes.c_uint64(0)]  # global and profile scratch
        params = (ctypes.c_void_p * len(keep))(*[ctypes.addressof(v) for v in keep])
        dev = torch.cuda.current_device()
        stream = torch.cuda.current_stream(dev).cuda_stream
        _driver().launch(self.function(dev), g[:3], 32 * self.num_warps, self.shared, stream,
                         params)
        return None


# ---------------------------------------------------------------- installing an engine's


def install(binaries: dict[str, Binary]) -> int:
    """Make ``binaries`` (key -> Binary) available to :func:`launch`; returns how many."""
    with _TABLE_LOCK:
        for k, b in binaries.items():
            _TABLE.setdefault(k, b)
    return len(binaries)


def installed() -> int:
    return len(_TABLE)


def clear() -> None:
    """Forget every installed binary (tests)."""
    with _TABLE_LOCK:
        _TABLE.clear()


def pack(binaries: dict[str, Binary], tensors: dict[str, np.ndarray]) -> dict:
    """The engine header's ``triton_binaries`` section; the cubins go into ``tensors``."""
    kernels = []
    for i, (key, b) in enumerate(sorted(binaries.items())):
        name = f"triton{i}"
        tensors[name] = np.frombuffer(b.cubin, dtype=np.uint8)
        kernels.append(dict(b.to_json(name), key=key))
    return {"digest": kernels_digest(), "triton_version": lazy.version(),
            "abi": triton_abi(), "kernels": kernels}


def unpack(section: dict, tensors: dict[str, np.ndarray]) -> dict[str, Binary]:
    """Binaries from an engine header's section (ValueError/KeyError on a damaged one)."""
    return {str(d["key"]): Binary.from_json(d, tensors[d["tensor"]].tobytes())
            for d in section.get("kernels", [])}


def usable(section: dict) -> str | None:
    """Why an engine's binaries cannot be used in this process, or None when they can."""
    if section.get("digest") != kernels_digest():
        return "kiln's Triton kernel sources differ from the build's"
    abi = triton_abi()
    if abi is None or section.get("abi") != abi:
        return "this Triton's launch convention is not the build's"
    here = lazy.version()
    if here is None:
        return "Triton is not installed"
    if section.get("triton_version") != here:
        return f"Triton {here} here, {section.get('triton_version')} at build"
    return None


# ---------------------------------------------------------------- the CUDA driver


class _Driver:
    """The few CUDA driver calls launching a cubin needs, through ctypes."""

    def __init__(self):
        self.lib = lib = ctypes.CDLL("libcuda.so.1")
        vp, pvp, ci = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
        sig = {"cuCtxGetCurrent": [pvp], "cuCtxSetCurrent": [vp],
               "cuDevicePrimaryCtxRetain": [pvp, ci], "cuDeviceGet": [ctypes.POINTER(ci), ci],
               "cuModuleLoadData": [pvp, ctypes.c_char_p],
               "cuModuleGetFunction": [pvp, vp, ctypes.c_char_p],
               "cuFuncGetAttribute": [ctypes.POINTER(ci), ci, vp],
               "cuFuncSetAttribute": [vp, ci, ci], "cuFuncSetCacheConfig": [vp, ci],
               "cuDeviceGetAttribute": [ctypes.POINTER(ci), ci, ci],
               "cuLaunchKernel": [vp] + [ctypes.c_uint] * 6 + [ctypes.c_uint, vp, pvp, pvp],
               "cuGetErrorName": [ci, ctypes.POINTER(ctypes.c_char_p)]}
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ci

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(s))
            from kiln.errors import KernelError
            raise KernelError(f"CUDA driver: {what} failed with "
                              f"{(s.value or b'?').decode()} ({rc})")

    def load(self, cubin: bytes, name: str, shared: int, device: int) -> int:
        lib, c = self.lib, self.check
        ctx = ctypes.c_void_p()
        c(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            c(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
            c(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        c(lib.cuModuleLoadData(ctypes.byref(mod), cubin), f"loading kernel {name}")
        c(lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"finding {name}")
        if shared > 49152:
            dev, optin, static = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            c(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
            c(lib.cuDeviceGetAttribute(ctypes.byref(optin), 97, dev), "cuDeviceGetAttribute")
            if optin.value > 49152:
                c(lib.cuFuncSetCacheConfig(fn, 1), "cuFuncSetCacheConfig")  # PREFER_SHARED
                # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1, ..._MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
                c(lib.cuFuncGetAttribute(ctypes.byref(static), 1, fn), "cuFuncGetAttribute")
                c(lib.cuFuncSetAttribute(fn, 8, optin.value - static.value),
                  "cuFuncSetAttribute")
        return fn.value

    def launch(self, fn: int, grid: tuple, threads: int, shared: int, stream: int,
               params) -> None:
        self.check(self.lib.cuLaunchKernel(fn, grid[0], grid[1], grid[2], threads, 1, 1, shared,
                                           stream or None, params, None), "cuLaunchKernel")


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER
