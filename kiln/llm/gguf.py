"""GGUF files (llama.cpp's format): metadata, tensor directory, dequantization to float32.

Layout (little-endian): ``b"GGUF"``, version u32 (2 or 3), tensor count u64, metadata count u64,
the metadata as (key, type, value), the tensor infos as (name, n_dims, dims[ne0 first], ggml type,
offset), padding to ``general.alignment`` (32), then the tensor data. Dims list the innermost
first, so a numpy shape is the reverse.

Quantized blocks hold 32 weights each:

- ``Q8_0``: f16 scale ``d``, 32 int8 ``q``;            w = d * q
- ``Q4_0``: f16 ``d``, 16 bytes of nibbles;            w = d * (q - 8)
- ``Q4_1``: f16 ``d``, f16 ``m``, 16 bytes of nibbles; w = d * q + m
  (byte j holds weight j in its low nibble and weight j + 16 in its high nibble)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import ModelLoadError

MAGIC = b"GGUF"

# metadata value types
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# ggml tensor types kiln dequantizes, and the names of the rest (for the error message)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
GGML_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
              16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
              22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
              29: "IQ1_M", 30: "BF16"}
# bytes per block of 32 weights (or per weight for the plain types, block size 1)
_BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    ggml_type: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_NAMES.get(self.ggml_type, f"type {self.ggml_type}")

    @property
    def nbytes(self) -> int:
        block, size = _BLOCK[self.ggml_type]
        return int(np.prod(self.shape)) // block * size


class _Reader:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF file is truncated at byte {self.pos}")
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return vals[0] if len(vals) == 1 else vals

    def string(self) -> str:
        n = self.take("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise ModelLoadError(f"{self.path}: GGUF file is truncated inside a string")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS:  # read numeric arrays in one go
                dt = np.dtype(_SCALARS[etype])
                arr = np.frombuffer(self.buf, dt, count, self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ModelLoadError(f"{self.path}: unknown GGUF metadata type {vtype}")
        dt = np.dtype(_SCALARS[vtype])
        if self.pos + dt.itemsize > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF file is truncated at byte {self.pos}")
        v = np.frombuffer(self.buf, dt, 1, self.pos)[0].item()
        self.pos += dt.itemsize
        return bool(v) if vtype == 7 else v


class GGUFFile:
    """A GGUF file, memory-mapped: ``metadata`` (dict), ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot open GGUF file {self.path}: {e}") from e
        r = _Reader(self._mm, self.path)
        if bytes(self._mm[:4]) != MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (magic {bytes(self._mm[:4])!r})")
        r.pos = 4
        self.version = r.take("<I")
        if self.version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {self.version} is not supported "
                                 "(kiln reads versions 2 and 3)")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = r.string()
            self.metadata[key] = r.value(r.take("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            gtype, offset = r.take("<I"), r.take("<Q")
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), gtype, offset)
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = (r.pos + align - 1) // align * align

    def raw(self, info: TensorInfo) -> np.ndarray:
        if info.ggml_type not in _BLOCK:
            raise ModelLoadError(
                f"{self.path}: tensor {info.name!r} is {info.type_name}; kiln dequantizes F32, "
                "F16, BF16, Q8_0, Q4_0 and Q4_1 only (re-quantize the model to one of those)")
        start = self.data_start + info.offset
        if start + info.nbytes > len(self._mm):
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} runs past the end of the file")
        return np.frombuffer(self._mm, np.uint8, info.nbytes, start)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor ``name`` as float32 in numpy order."""
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: no tensor named {name!r}")
        info = self.tensors[name]
        return dequantize(self.raw(info), info.ggml_type).reshape(info.shape)


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Flat float32 weights from the bytes of one tensor of ``ggml_type``."""
    if ggml_type == F32:
        return raw.view("<f4").copy()
    if ggml_type == F16:
        return raw.view("<f2").astype(np.float32)
    if ggml_type == BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    blocks = raw.reshape(-1, _BLOCK[ggml_type][1])
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    if ggml_type == Q8_0:
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    head = 4 if ggml_type == Q4_1 else 2
    qs = blocks[:, head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # weights 0-15, 16-31
    if ggml_type == Q4_0:
        return (d * (q - 8.0)).reshape(-1)
    m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    return (d * q + m).reshape(-1)


def quantize_q4_1(w: np.ndarray) -> bytes:
    """float weights -> Q4_1 bytes (what llama.cpp's quantizer writes); for tests and tools."""
    x = np.asarray(w, np.float32).reshape(-1, 32)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / 15.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0.0)
    q = np.clip(np.round((x - lo) * inv), 0, 15).astype(np.uint8)
    packed = (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)
    head = np.concatenate([d.astype("<f2").view(np.uint8), lo.astype("<f2").view(np.uint8)], 1)
    return np.concatenate([head, packed], axis=1).tobytes()


def quantize_q8_0(w: np.ndarray) -> bytes:
    """float weights -> Q8_0 bytes; for tests and tools."""
    x = np.asarray(w, np.float32).reshape(-1, 32)
    d = np.abs(x).max(axis=1, keepdims=True) / 127.0
    q = np.round(x / np.where(d > 0, d, 1)).astype(np.int8)
    return np.concatenate([d.astype("<f2").view(np.uint8), q.view(np.uint8)], axis=1).tobytes()
