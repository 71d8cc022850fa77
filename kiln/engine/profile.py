"""Optimization profiles and the checks that refuse bad inputs before any work is done."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kiln.errors import ShapeError


@dataclass(frozen=True)
class Profile:
    """Per input, the smallest, the tuned-for and the largest shape the engine accepts."""

    min: dict[str, tuple[int, ...]] = field(default_factory=dict)
    opt: dict[str, tuple[int, ...]] = field(default_factory=dict)
    max: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def fixed(cls, shapes: dict[str, tuple[int, ...]]) -> Profile:
        s = {k: tuple(v) for k, v in shapes.items()}
        return cls(dict(s), dict(s), dict(s))

    def names(self) -> set[str]:
        return set(self.min) | set(self.opt) | set(self.max)

    def range_str(self, name: str) -> str:
        lo, hi = self.min.get(name), self.max.get(name)
        if lo is None:
            return "any shape"
        return "x".join(str(d) for d in lo) + " .. " + "x".join(str(d) for d in hi)

    def fits(self, name: str, shape: tuple[int, ...]) -> bool:
        lo, hi = self.min.get(name), self.max.get(name)
        if lo is None:
            return True
        return len(shape) == len(lo) and all(a <= d <= b for a, d, b in zip(lo, shape, hi))

    def to_json(self) -> dict:
        return {"min": _lists(self.min), "opt": _lists(self.opt), "max": _lists(self.max)}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(*({k: tuple(v) for k, v in d[key].items()} for key in ("min", "opt", "max")))

    def at(self, shapes: dict[str, tuple[int, ...]]) -> Profile:
        """This profile with ``shapes`` as its tuned-for shapes (a tuning point in it)."""
        return Profile(dict(self.min), {k: tuple(v) for k, v in shapes.items()}, dict(self.max))


TUNE_AT = ("opt", "all")  # BuilderConfig.tune_at


def tuning_points(p: Profile, at: str = "all") -> list[dict[str, tuple[int, ...]]]:
    """The shapes a profile's kernels are tuned at, smallest first: its opt shapes
    (``at="opt"``, TensorRT's way), or its min, opt and max shapes (``"all"``), each once. A
    run takes the kernels of the first point that is at least as large as its inputs in every
    dim (:func:`bucket_of`), so a range's small and large ends get kernels timed there."""
    if at not in TUNE_AT:
        raise ValueError(f"tune_at must be one of {TUNE_AT}, not {at!r}")
    points = [p.opt] if at == "opt" else [p.min, p.opt, p.max]
    out: list[dict] = []
    for pt in points:
        pt = {k: tuple(v) for k, v in pt.items()}
        if pt not in out:
            out.append(pt)
    return out


def bucket_of(points: list[dict[str, tuple[int, ...]]], shapes: dict[str, tuple]) -> int:
    """Index of the first tuning point at least as large as ``shapes`` in every dim of every
    input it names (the last point where none is: a shape past opt in one dim and under it in
    another)."""
    for k, pt in enumerate(points):
        if all(len(shapes[n]) == len(s) and all(a <= b for a, b in zip(shapes[n], s))
               for n, s in pt.items() if n in shapes):
            return k
    return len(points) - 1


def _lists(d):
    return {k: list(v) for k, v in d.items()}


def validate_profile(p: Profile, inputs: list) -> None:
    """Check a profile against the model's inputs (``TensorInfo`` list) at build time."""
    known = {i.name: i for i in inputs}
    for name in p.names():
        if name not in known:
            raise ShapeError(f"profile names input '{name}', which the model does not have; "
                             f"its inputs are {sorted(known)}")
        lo, opt, hi = p.min.get(name), p.opt.get(name), p.max.get(name)
        if lo is None or opt is None or hi is None:
            raise ShapeError(f"profile for input '{name}' needs min, opt and max shapes")
        info = known[name]
        for s, what in ((lo, "min"), (opt, "opt"), (hi, "max")):
            if info.shape is not None and len(s) != len(info.shape):
                raise ShapeError(f"profile {what} shape {_fmt(s)} for input '{name}' has rank "
                                 f"{len(s)}, but the input has rank {len(info.shape)}")
            for k, (d, m) in enumerate(zip(s, info.shape or ())):
                if isinstance(m, int) and d != m:
                    raise ShapeError(f"profile {what} shape {_fmt(s)} for input '{name}' sets "
                                     f"dim {k} to {d}, but the model fixes it at {m}")
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise ShapeError(f"profile for input '{name}' needs min <= opt <= max in every "
                             f"dim; got {_fmt(lo)}, {_fmt(opt)}, {_fmt(hi)}")


def _fmt(s) -> str:
    return "x".join(str(d) for d in s) if len(s) else "scalar"


def check_feeds(inputs: list, feeds: dict, profiles: list[Profile], dtype_of) -> int:
    """Refuse missing/extra inputs, wrong dtype or rank, and shapes outside every profile.

    Returns the index of the first profile that fits (-1 when the engine has none)."""
    names = [i.name for i in inputs]
    missing = [n for n in names if n not in feeds]
    if missing:
        raise ShapeError(f"missing input(s) {missing}; the engine's inputs are {names}")
    extra = [n for n in feeds if n not in names]
    if extra:
        raise ShapeError(f"unknown input(s) {extra}; the engine's inputs are {names}")
    bound: dict[str, tuple[int, str]] = {}
    for info in inputs:
        x = feeds[info.name]
        if info.dtype is not None:
            got = dtype_of(x)
            if got != info.dtype:
                raise ShapeError(f"input '{info.name}' has dtype {got.name}, but the engine "
                                 f"expects {info.dtype.name}; convert it before calling run")
        shape = tuple(x.shape) if hasattr(x, "shape") else None
        if info.shape is not None and shape is not None:
            _check_dims(info, shape, bound)
    if not profiles:
        return -1
    for k, p in enumerate(profiles):
        if all(p.fits(i.name, tuple(feeds[i.name].shape)) for i in inputs):
            return k
    bad = next(i.name for i in inputs if not any(
        p.fits(i.name, tuple(feeds[i.name].shape)) for p in profiles))
    ranges = "; ".join(f"profile {k}: {p.range_str(bad)}" for k, p in enumerate(profiles))
    raise ShapeError(f"input '{bad}' has shape {_fmt(tuple(feeds[bad].shape))}, outside every "
                     f"optimization profile ({ranges}); rebuild with a profile that covers it")


@functools.lru_cache(maxsize=1024)
def _dim_name(m) -> str | None:
    """A symbolic dim's name when it is a plain name (not an expression); cached, since
    printing a sympy symbol on every run cost ~9 us a dim (timeit, str(Symbol("batch")))."""
    s = str(m)
    return s if s.isidentifier() else None


def _check_dims(info, shape: tuple, bound: dict) -> None:
    if len(shape) != len(info.shape):
        raise ShapeError(f"input '{info.name}' has rank {len(shape)} (shape {_fmt(shape)}), but "
                         f"the engine expects rank {len(info.shape)} ({info.shape_str()})")
    for k, (d, m) in enumerate(zip(shape, info.shape)):
        if isinstance(m, int):
            if d != m:
                raise ShapeError(f"input '{info.name}' has shape {_fmt(shape)}, but dim {k} must "
                                 f"be {m} (expected {info.shape_str()})")
        elif m is not None and (name := _dim_name(m)) is not None:
            prev = bound.setdefault(name, (d, info.name))
            if prev[0] != d:
                raise ShapeError(
                    f"input '{info.name}' dim {k} ('{m}') is {d}, but input '{prev[1]}' set "
                    f"'{m}' to {prev[0]}; dims with the same name must agree")
