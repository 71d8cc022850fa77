"""Dim normalisation: sympy.simplify once per expression, inner integer functions first."""

import sympy

import kiln.ir.types as T
from kiln.ir.types import as_dim, sym


def _nested_ceil(d, depth):
    for _ in range(depth):
        d = sympy.ceiling(d / 2)
    return d


def test_as_dim_simplifies_inside_nested_functions():
    h = sym("h")
    # floor((2*ceiling(h/2) + 1)/2) -> ceiling(h/2): the inner ceiling is an opaque integer
    assert as_dim(sympy.floor((2 * sympy.ceiling(h / 2) + 1) / 2)) == sympy.ceiling(h / 2)
    # floor((h + 2 - 3)/2) + 1 -> a form sympy writes; still equal for every h
    d = as_dim(sympy.floor((h + 2 - 3) / 2) + 1)
    assert all(d.subs(h, v) == (v - 1) // 2 + 1 for v in range(1, 20))
    assert as_dim(sympy.Integer(3) + sympy.ceiling(sympy.Integer(5) / 2)) == 6
    assert isinstance(as_dim(sympy.Integer(4)), int)


def test_as_dim_caches_and_does_not_resimplify(monkeypatch):
    calls = []
    real = sympy.simplify
    monkeypatch.setattr(T.sympy, "simplify", lambda e, *a, **k: calls.append(e) or real(e))
    T._SIMPLIFIED.clear()
    d = _nested_ceil(sym("w"), 6)
    got = as_dim(d)
    assert got == d
    n = len(calls)
    # one top-level simplify per nesting level, each of a one-level expression
    assert n <= 6 and all(len(e.atoms(sympy.Function)) <= 1 for e in calls)
    assert as_dim(d) == d and as_dim(got) == d
    assert len(calls) == n  # cached: neither the input nor its result is simplified again


def test_broadcast_shapes_symbolic_dims_without_printing(monkeypatch):
    from kiln.ops.rules import broadcast_shapes

    def no_str(self):
        raise AssertionError("broadcast_shapes printed a sympy dim")

    h = _nested_ceil(sym("h"), 3)
    monkeypatch.setattr(sympy.Basic, "__str__", no_str)
    assert broadcast_shapes((1, 8, h, h), (1, 8, h, h)) == (1, 8, h, h)
    assert broadcast_shapes((1, 8, h, 1), (8, 1, 5)) == (1, 8, h, 5)
    assert broadcast_shapes((h,), (4,)) == (4,)  # a fixed size wins over an expression
    assert broadcast_shapes((None,), (1,)) == (None,)


def _sympify_parse(s):
    """What dim_from_str gave before its own parser: sympify, the symbols made kiln's."""
    e = sympy.sympify(s, locals={})
    e = e.subs({n: sym(n.name) for n in e.free_symbols})
    return int(e) if e.is_Integer else e


def test_dim_parse_matches_sympify_on_what_kiln_writes():
    h, w, b = sym("h"), sym("w"), sym("batch")
    r = sympy.Rational(191, 128)
    dims = [h + 64, h / 128 - r, sympy.ceiling(h / 128 - r),
            sympy.floor((w - 1) / 2) + 1, 2 * h * w, sympy.Max(h, 4) - sympy.Min(w, 2), -h + 3,
            sympy.ceiling(sympy.ceiling(h / 2) / 2), sympy.Mod(h, 8) + b, h ** 2, b * (h + 1)]
    for d in dims:
        s = T.dim_str(d)
        got = T._parse_fast(s)
        assert got == _sympify_parse(s) == d, s
        assert got.free_symbols <= {h, w, b} and all(x.is_integer for x in got.free_symbols)


def test_dim_parse_leaves_the_rest_to_sympify():
    for s in ("h.x", "lambda: 1", "f(h)", "h[0]", "1.5*h", "h if w else 1"):
        assert T._parse_fast(s) is None, s
    assert T.dim_from_str("1.5*h") == sympy.Float(1.5) * sym("h")
