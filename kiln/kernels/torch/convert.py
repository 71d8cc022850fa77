"""Moving values between numpy (the user's and ONNX's) and torch (the kernels')."""

from __future__ import annotations

import numpy as np
import torch

from kiln.ir import DType

TORCH_DTYPE: dict[DType, torch.dtype] = {
    DType.float32: torch.float32, DType.float16: torch.float16, DType.float64: torch.float64,
    DType.bfloat16: torch.bfloat16, DType.int8: torch.int8, DType.uint8: torch.uint8,
    DType.int16: torch.int16, DType.int32: torch.int32, DType.int64: torch.int64,
    DType.bool: torch.bool, DType.complex64: torch.complex64, DType.complex128: torch.complex128,
    DType.uint16: torch.uint16, DType.uint32: torch.uint32, DType.uint64: torch.uint64,
    DType.float8e4m3fn: torch.float8_e4m3fn, DType.float8e4m3fnuz: torch.float8_e4m3fnuz,
    DType.float8e5m2: torch.float8_e5m2, DType.float8e5m2fnuz: torch.float8_e5m2fnuz,
    DType.float8e8m0: torch.float8_e8m0fnu,
}
DTYPE_OF_TORCH = {v: k for k, v in TORCH_DTYPE.items()}

# dtypes numpy cannot hand to torch directly: viewed as same-width ints in between
_VIA = {
    torch.bfloat16: (np.int16, torch.int16),
    torch.float8_e4m3fn: (np.uint8, torch.uint8), torch.float8_e4m3fnuz: (np.uint8, torch.uint8),
    torch.float8_e5m2: (np.uint8, torch.uint8), torch.float8_e5m2fnuz: (np.uint8, torch.uint8),
    torch.float8_e8m0fnu: (np.uint8, torch.uint8),
}


def to_torch(a):
    """numpy array -> torch tensor; arrays of dtypes torch lacks stay numpy."""
    if isinstance(a, torch.Tensor) or a is None:
        return a
    if type(a) is np.ndarray and a.dtype in _PLAIN_NP and a.flags.c_contiguous \
            and a.flags.writeable:  # the common case, without the lookups below (~3 us)
        return torch.from_numpy(a)
    if isinstance(a, list):
        return [to_torch(x) for x in a]
    a = np.asarray(a)
    try:
        dt = DType.from_np(a.dtype)
    except ValueError:
        return a
    tdt = TORCH_DTYPE.get(dt)
    if tdt is None:
        return a
    if not a.flags.c_contiguous:  # ascontiguousarray would turn a 0-d array into 1-d
        a = np.ascontiguousarray(a).reshape(a.shape)
    if tdt in _VIA:
        npv, tv = _VIA[tdt]
        return torch.from_numpy(a.view(npv).copy()).view(tdt)
    return torch.from_numpy(a.copy() if not a.flags.writeable else a)


def to_numpy(t):
    """torch tensor -> numpy array with the matching (ml_dtypes) dtype."""
    if isinstance(t, np.ndarray) or t is None:
        return t
    if type(t) is torch.Tensor and t.dtype in _PLAIN_TORCH and t.is_cpu \
            and not t.requires_grad and t.is_contiguous():
        return t.numpy()
    if isinstance(t, list):
        return [to_numpy(x) for x in t]
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu().contiguous()
    if t.dtype in _VIA:
        npv, tv = _VIA[t.dtype]
        return t.view(tv).numpy().view(DTYPE_OF_TORCH[t.dtype].np)
    return t.numpy()


# dtypes numpy and torch share bit for bit (from_numpy / .numpy() take them as they are)
_PLAIN_TORCH = frozenset(t for t in TORCH_DTYPE.values() if t not in _VIA)
_PLAIN_NP = frozenset(np.dtype(d.np) for d, t in TORCH_DTYPE.items() if t in _PLAIN_TORCH
                      and np.dtype(d.np).kind in "biuf")


def dtype_of(x) -> DType:
    if isinstance(x, torch.Tensor):
        return DTYPE_OF_TORCH[x.dtype]
    return DType.from_np(np.asarray(x).dtype)
