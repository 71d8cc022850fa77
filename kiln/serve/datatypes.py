"""Tensor datatypes at the protocol boundary: the KServe v2 names ("FP32"), the model config's
enum (TYPE_FP32), numpy dtypes, and the BYTES wire form (each element a 4-byte little-endian
length, then its bytes)."""

from __future__ import annotations

import struct

import numpy as np

from kiln.serve.errors import invalid

# KServe v2 name -> numpy dtype (BYTES: numpy object arrays of bytes)
NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
# the model config's TYPE_<x> enum names, where they differ from KServe's ("STRING" = BYTES)
CONFIG_NAME = {"BYTES": "STRING"}


def from_config(type_name: str) -> str:
    """``"TYPE_FP32"`` -> ``"FP32"``; ``"TYPE_STRING"`` -> ``"BYTES"``."""
    name = type_name.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def to_config(datatype: str) -> str:
    return "TYPE_" + CONFIG_NAME.get(datatype, datatype)


def from_numpy(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    for name, d in NUMPY.items():
        if d == dtype:
            return name
    raise invalid(f"numpy dtype {dtype} has no KServe v2 datatype")


def numpy_dtype(datatype: str, where: str) -> np.dtype:
    try:
        return NUMPY[datatype]
    except KeyError:
        raise invalid(f"{where}: unknown datatype '{datatype}' (one of "
                      f"{', '.join(NUMPY)})") from None


def decode_bytes(raw: bytes | memoryview, count: int, where: str) -> np.ndarray:
    """BYTES wire form -> object array of ``count`` bytes elements."""
    out, pos, raw = [], 0, memoryview(raw)
    for _ in range(count):
        if pos + 4 > len(raw):
            raise invalid(f"{where}: BYTES data ends inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise invalid(f"{where}: a BYTES element of {n} bytes runs past the data's end")
        out.append(bytes(raw[pos:pos + n]))
        pos += n
    if pos != len(raw):
        raise invalid(f"{where}: {len(raw) - pos} bytes left after {count} BYTES elements")
    return np.array(out + [None], dtype=object)[:-1] if out else np.empty(0, dtype=object)


def encode_bytes(arr: np.ndarray) -> bytes:
    parts = []
    for x in arr.reshape(-1):
        b = x if isinstance(x, bytes) else str(x).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def to_raw(arr: np.ndarray) -> bytes:
    """An output array as its wire bytes (row-major; BYTES length-prefixed)."""
    if arr.dtype.kind in "OSU":
        return encode_bytes(arr)
    return np.ascontiguousarray(arr).tobytes()


def from_raw(raw, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Wire bytes -> array of ``shape``; the size must match exactly."""
    count = element_count(shape, where)
    if datatype == "BYTES":
        return decode_bytes(raw, count, where).reshape(shape)
    dtype = numpy_dtype(datatype, where)
    want = count * dtype.itemsize
    if len(raw) != want:
        raise invalid(f"{where}: {len(raw)} bytes of data for shape {list(shape)} of "
                      f"{datatype}, which needs {want}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


MAX_ELEMENTS = 1 << 34  # elements in one tensor: beyond this a shape is refused, not allocated


def element_count(shape, where: str) -> int:
    n = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise invalid(f"{where}: shape {list(shape)} must hold non-negative integers")
        n *= d
        if n > MAX_ELEMENTS:
            raise invalid(f"{where}: shape {list(shape)} has more than {MAX_ELEMENTS} "
                          f"elements")
    return n
