"""The engine file: one self-contained file per built engine.

Layout (all integers little-endian)::

    offset 0   magic      8 bytes   b"KILNENG\\x00"
    offset 8   version    u32       FORMAT_VERSION
    offset 12  header_len u32       length of the JSON header
    offset 16  header     JSON      versions, device, build config, plan, tensor table
               padding to a 64-byte boundary
    blob       raw tensor bytes, each tensor 64-byte aligned (memory-mapped at load, zero-copy)
    trailer    16 bytes  xxh3-64 of every byte before the trailer, then b"KILNEND\\x00"

Nothing in the file is executed when it is read: the header and plan are JSON and tensors are raw
bytes with a dtype and shape from the JSON. Writes go to a temporary file that is renamed into
place, so an interrupted build never leaves a file that looks like an engine.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kiln.errors import EngineFileError
from kiln.ir import DType
from kiln.runtime import host

MAGIC = b"KILNENG\x00"
END = b"KILNEND\x00"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII")
_TRAILER = struct.Struct("<Q8s")


def _pad(n: int) -> int:
    return (-n) % ALIGN


@dataclass
class EngineFile:
    header: dict
    tensors: dict[str, np.ndarray]
    size: int


def write_engine(path: str | os.PathLike, header: dict, tensors: dict[str, np.ndarray]) -> int:
    """Write header + tensors atomically; returns the file size."""
    path = Path(path)
    table, chunks, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # keeps 0-d arrays 0-d
        if arr.dtype == object:
            raise EngineFileError(f"tensor '{name}' holds Python objects; store it in the plan")
        raw = arr.tobytes()
        table[name] = {"dtype": DType.from_np(arr.dtype).name, "shape": list(arr.shape),
                       "offset": offset, "nbytes": len(raw)}
        chunks.append(raw)
        chunks.append(b"\x00" * _pad(len(raw)))
        offset += len(raw) + _pad(len(raw))
    header = dict(header, tensors=table)
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(hbytes)) + hbytes
    prefix += b"\x00" * _pad(len(prefix))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        h = xxhash.xxh3_64()
        with os.fdopen(fd, "wb") as f:
            for part in (prefix, *chunks):
                f.write(part)
                h.update(part)
            f.write(_TRAILER.pack(h.intdigest(), END))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header alone (no weights read, no checksum over the blob)."""
    path = _existing(path)
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        version, hlen = _check_prefix(head, path)
        raw = f.read(hlen)
    if len(raw) != hlen:
        raise EngineFileError(f"'{path}' is truncated inside its header; rebuild the engine")
    return _parse_header(raw, path)


def read_engine(path: str | os.PathLike, verify: bool = True) -> EngineFile:
    """Map the file, verify its checksum and return the header and zero-copy tensor views."""
    path = _existing(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < _PREFIX.size + _TRAILER.size:
            head = f.read(_PREFIX.size)
            _check_prefix(head, path)
            raise EngineFileError(f"'{path}' is truncated ({size} bytes); rebuild the engine")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    _register(mm, size)
    version, hlen = _check_prefix(mm[:_PREFIX.size], path)
    digest, end = _TRAILER.unpack(mm[size - _TRAILER.size:])
    if end != END:
        raise EngineFileError(
            f"'{path}' is truncated or damaged (no end marker); rebuild the engine")
    if verify and xxhash.xxh3_64_intdigest(memoryview(mm)[:size - _TRAILER.size]) != digest:
        raise EngineFileError(
            f"'{path}' is corrupted: its checksum does not match its contents; rebuild the "
            "engine or copy it again")
    header = _parse_header(mm[_PREFIX.size:_PREFIX.size + hlen], path)
    blob = _PREFIX.size + hlen
    blob += _pad(blob)
    tensors = {}
    for name, t in header.get("tensors", {}).items():
        dt = DType[t["dtype"]].np
        count = int(np.prod(t["shape"], dtype=np.int64))
        arr = np.frombuffer(mm, dtype=dt, count=count, offset=blob + t["offset"])
        tensors[name] = arr.reshape(t["shape"])
    return EngineFile(header, tensors, size)


def _register(mm: mmap.mmap, size: int) -> None:
    """Tell kiln.runtime.host that this private file mapping holds weights it may hand pages
    of back once kernels have packed them, until the mapping is closed."""
    start = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data
    host.register_file_mapping(start, size)
    weakref.finalize(mm, host.unregister_file_mapping, start)


def _existing(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise EngineFileError(f"engine file '{path}' does not exist; build it with `kiln build`")
    if path.is_dir():
        raise EngineFileError(f"'{path}' is a folder, not an engine file")
    return path


def _check_prefix(head: bytes, path: Path) -> tuple[int, int]:
    if len(head) < _PREFIX.size or head[:8] != MAGIC:
        hint = " (it looks like an ONNX model: build it first with `kiln build`)" if (
            path.suffix == ".onnx") else ""
        raise EngineFileError(f"'{path}' is not a kiln engine file{hint}")
    _, version, hlen = _PREFIX.unpack(head)
    if version > FORMAT_VERSION:
        raise EngineFileError(
            f"'{path}' has engine format version {version}, newer than this kiln reads "
            f"({FORMAT_VERSION}); upgrade kiln or rebuild the engine with this version")
    if version < 1:
        raise EngineFileError(f"'{path}' has an invalid format version {version}; rebuild it")
    return version, hlen


def _parse_header(raw: bytes, path: Path) -> dict:
    try:
        header = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise EngineFileError(f"'{path}' has a damaged header; rebuild the engine") from None
    if not isinstance(header, dict):
        raise EngineFileError(f"'{path}' has a damaged header; rebuild the engine")
    return header
