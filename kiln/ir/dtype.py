"""Element types, numbered as ONNX numbers them (TensorProto.DataType)."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    float32 = 1
    uint8 = 2
    int8 = 3
    uint16 = 4
    int16 = 5
    int32 = 6
    int64 = 7
    string = 8
    bool = 9
    float16 = 10
    float64 = 11
    uint32 = 12
    uint64 = 13
    complex64 = 14
    complex128 = 15
    bfloat16 = 16
    float8e4m3fn = 17
    float8e4m3fnuz = 18
    float8e5m2 = 19
    float8e5m2fnuz = 20
    uint4 = 21
    int4 = 22
    float4e2m1 = 23
    float8e8m0 = 24
    uint2 = 25
    int2 = 26
    float6e2m3 = 27
    float6e3m2 = 28

    @property
    def onnx(self) -> int:
        return self.value

    @property
    def np(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @classmethod
    def from_onnx(cls, code: int) -> DType:
        try:
            return cls(code)
        except ValueError:
            raise ValueError(f"unknown ONNX element type {code}") from None

    @classmethod
    def from_np(cls, dtype) -> DType:
        dtype = np.dtype(dtype)
        if dtype.kind in "OUS":
            return cls.string
        for d, n in _NUMPY.items():
            if n == dtype:
                return d
        raise ValueError(f"numpy dtype {dtype} has no kiln DType")

    def __str__(self) -> str:
        return self.name


_NUMPY = {
    DType.float32: np.dtype(np.float32),
    DType.uint8: np.dtype(np.uint8),
    DType.int8: np.dtype(np.int8),
    DType.uint16: np.dtype(np.uint16),
    DType.int16: np.dtype(np.int16),
    DType.int32: np.dtype(np.int32),
    DType.int64: np.dtype(np.int64),
    DType.string: np.dtype(object),
    DType.bool: np.dtype(np.bool_),
    DType.float16: np.dtype(np.float16),
    DType.float64: np.dtype(np.float64),
    DType.uint32: np.dtype(np.uint32),
    DType.uint64: np.dtype(np.uint64),
    DType.complex64: np.dtype(np.complex64),
    DType.complex128: np.dtype(np.complex128),
    DType.bfloat16: np.dtype(ml_dtypes.bfloat16),
    DType.float8e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.float8e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DType.float8e5m2: np.dtype(ml_dtypes.float8_e5m2),
    DType.float8e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DType.uint4: np.dtype(ml_dtypes.uint4),
    DType.int4: np.dtype(ml_dtypes.int4),
    DType.float4e2m1: np.dtype(ml_dtypes.float4_e2m1fn),
    DType.float8e8m0: np.dtype(ml_dtypes.float8_e8m0fnu),
    DType.uint2: np.dtype(ml_dtypes.uint2),
    DType.int2: np.dtype(ml_dtypes.int2),
    DType.float6e2m3: np.dtype(ml_dtypes.float6_e2m3fn),
    DType.float6e3m2: np.dtype(ml_dtypes.float6_e3m2fn),
}

_FLOATS = {
    DType.float32, DType.float16, DType.float64, DType.bfloat16, DType.float8e4m3fn,
    DType.float8e4m3fnuz, DType.float8e5m2, DType.float8e5m2fnuz, DType.float4e2m1,
    DType.float8e8m0, DType.float6e2m3, DType.float6e3m2,
}
_INTS = {
    DType.uint8, DType.int8, DType.uint16, DType.int16, DType.int32, DType.int64,
    DType.uint32, DType.uint64, DType.uint4, DType.int4, DType.uint2, DType.int2,
}
