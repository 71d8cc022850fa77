"""Specializing a model to an optimization profile's fixed dims at import.

A profile whose min, opt and max agree on a dim fixes that dim for every run the engine will
accept. Giving the graph input that dim as a number (instead of ``batch`` or ``-1``) lets the
shape rules compute every shape subgraph built on it, which ``fold_constants`` then removes::

    x[1, 3, h, w] ─Shape─Gather(2)─Sub─Div─Neg─Concat─▶ pads ─Pad(x)      (TF "same" padding)
    with h, w fixed at 224:  Pad(x, [0, 0, 0, 0, 0, 0, 1, 1])  -> foldable into the conv

A named dim fixed on one input is fixed on every input that uses the name.
"""

from __future__ import annotations

import sympy

from kiln.ir import TensorType


def fixed_dims(profiles) -> dict[str, tuple[int | None, ...]]:
    """Per input, each dim every profile fixes to the same size (min == opt == max), else None.
    Inputs that some profile leaves out are not fixed."""
    if not profiles:
        return {}
    names = set.intersection(*(set(p.min) & set(p.opt) & set(p.max) for p in profiles))
    out = {}
    for name in names:
        shapes = [s for p in profiles for s in (p.min[name], p.opt[name], p.max[name])]
        if len({len(s) for s in shapes}) != 1:
            continue  # ranks disagree: validate_profile reports it
        out[name] = tuple(s[0] if all(x == s[0] for x in s) else None
                          for s in zip(*shapes))
    return out


def specialize_inputs(inputs: list, fixed: dict[str, tuple[int | None, ...]]) -> int:
    """Give the graph ``inputs`` (Values) the sizes ``fixed`` gives their dims; returns how many
    dims became numbers. Dims the model fixes itself and inputs of another rank are left for
    the profile check to judge."""
    names: dict[sympy.Symbol, set[int]] = {}
    for v in inputs:
        shape, want = getattr(v.type, "shape", None), fixed.get(v.name)
        if shape is None or want is None or len(want) != len(shape):
            continue
        for d, w in zip(shape, want):
            if isinstance(d, sympy.Symbol) and w is not None:
                names.setdefault(d, set()).add(w)
    subst = {s: next(iter(ws)) for s, ws in names.items() if len(ws) == 1}
    n = 0
    for v in inputs:
        shape, want = getattr(v.type, "shape", None), fixed.get(v.name)
        if shape is None:
            continue
        if want is None or len(want) != len(shape):
            want = (None,) * len(shape)
        new = tuple(_fixed(d, w, subst) for d, w in zip(shape, want))
        n += sum(a is not b for a, b in zip(new, shape))
        v.type = TensorType(v.type.dtype, new)
    return n


def _fixed(d, want, subst):
    if isinstance(d, int):
        return d
    if want is not None:
        return int(want)
    if isinstance(d, sympy.Expr) and d.free_symbols and d.free_symbols <= set(subst):
        got = d.subs(subst)
        return int(got) if got.is_Integer else d
    return d
