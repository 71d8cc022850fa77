"""Random inputs for an engine's inputs, for `kiln run` and `kiln bench`."""

from __future__ import annotations

import numpy as np

from kiln.errors import ShapeError


def concrete_shape(info, override: dict, profile) -> tuple[int, ...]:
    if info.name in override:
        return tuple(override[info.name])
    if profile is not None and info.name in profile.opt:
        return tuple(profile.opt[info.name])
    if info.shape is None:
        raise ShapeError(f"input '{info.name}' has unknown rank; give its shape with --shapes")
    return tuple(d if isinstance(d, int) else 1 for d in info.shape)


def random_inputs(inputs: list, override: dict | None = None, profile=None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Data for every input: N(0, 1) floats, ints in [0, 100), random bools.

    Symbolic dims take the profile's opt shape, else ``override``, else 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for info in inputs:
        shape = concrete_shape(info, override or {}, profile)
        dt = info.dtype.np if info.dtype is not None else np.dtype(np.float32)
        if dt.kind == "f" or info.dtype.is_float:
            out[info.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind in "iu":
            out[info.name] = rng.integers(0, 100, shape).astype(dt)
        elif dt.kind == "b":
            out[info.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            raise ShapeError(f"cannot make random data for input '{info.name}' of dtype "
                             f"{info.dtype}; pass it with --input {info.name}:file.npy")
    return out


def tuning_inputs(inputs: list, profile=None, seed: int = 0,
                  override: dict | None = None) -> dict[str, np.ndarray]:
    """What the builder's tuning run and :meth:`kiln.Engine.warm_up` feed: seeded random
    floats at the profile's opt shapes (or ``override``'s, as :func:`random_inputs`), zero
    integers and booleans (a valid index, token id, mask and trip count, where random ones
    would be out of range or run a Loop for ever)."""
    feeds = random_inputs(inputs, override or {}, profile, seed=seed)
    return {n: x if x.dtype.kind == "f" else np.zeros_like(x) for n, x in feeds.items()}

