"""Helpers shared by the PyTorch kernels."""

from __future__ import annotations

import functools

import numpy as np
import torch

from kiln.kernels.torch.convert import to_numpy, to_torch

# torch has few CPU kernels for unsigned ints wider than 8 bits: compute in a signed type
_WIDE = {torch.uint16: torch.int32, torch.uint32: torch.int64, torch.uint64: torch.int64}


def unsigned_safe(fn):
    """Run ``fn`` with uint16/32/64 tensor inputs widened to signed types; results that come
    back in the widened type are narrowed to the input dtype again."""

    @functools.wraps(fn)
    def wrapper(n, *xs):
        dt = next((x.dtype for x in xs if isinstance(x, torch.Tensor)), None)
        if dt not in _WIDE:
            return fn(n, *xs)
        wide = _WIDE[dt]
        out = fn(n, *[x.to(wide) if isinstance(x, torch.Tensor) and x.dtype == dt else x
                      for x in xs])
        if isinstance(out, tuple):
            return tuple(o.to(dt) if isinstance(o, torch.Tensor) and o.dtype == wide else o
                         for o in out)
        return out.to(dt) if isinstance(out, torch.Tensor) and out.dtype == wide else out
    return wrapper


def via_numpy(fn):
    """Run ``fn`` on numpy arrays (for dtypes or ops torch does not cover); the result goes
    back to torch where its dtype allows."""

    @functools.wraps(fn)
    def wrapper(n, *xs):
        out = fn(n, *[to_numpy(x) if isinstance(x, torch.Tensor) else x for x in xs])
        if isinstance(out, tuple):
            return tuple(to_torch(np.asarray(o)) if o is not None else None for o in out)
        return to_torch(np.asarray(out)) if out is not None else None
    return wrapper


def ints(t) -> list[int]:
    """A small int tensor input (axes, shape, pads...) as a Python list."""
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(t).reshape(-1)]
