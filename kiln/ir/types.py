"""Types of IR values: tensors with (possibly symbolic) shapes, sequences, optionals.

A dim is an ``int``, a sympy expression over named symbols (``batch``, ``seq*2``), or ``None``
when nothing is known about it. A shape of ``None`` means the rank itself is unknown.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Union

import sympy

from kiln.ir.dtype import DType

Dim = Union[int, sympy.Expr, None]
Shape = Union[tuple, None]


def sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def as_dim(d) -> Dim:
    """Normalise a dim: sympy integers become ints."""
    if d is None or isinstance(d, int):
        return d
    if isinstance(d, sympy.Expr):
        return _simplified(d)
    return int(d)


# shape inference runs to a fixed point and re-derives every dim on each round, and
# sympy.simplify of nested integer functions recurses into every level again and again:
# PaddleOCR det v4 (dynamic H, W; ceiling(ceiling(ceiling(h/2)/2)/2)... down its backbone)
# spent ~70 s of a 75 s build there. So each dim is simplified once (cached), and the integer
# functions inside it are simplified first and stand for themselves as opaque integer symbols
# while the outer level is simplified (sound: an identity over every integer holds for theirs).
def _simplified(d: sympy.Expr) -> Dim:
    got = _SIMPLIFIED.get(d)
    if got is None:
        inner = {f: _simplified(f) for f in d.atoms(sympy.Function) if f is not d}
        if inner:
            atoms = {f: sympy.Dummy(integer=True) for f, g in inner.items()
                     if isinstance(g, sympy.Expr)}
            back = {a: inner[f] for f, a in atoms.items()}
            flat = d.xreplace({f: atoms.get(f, g) for f, g in inner.items()})
            s = _simplify_top(flat).xreplace(back) if not flat.is_Integer else flat
        else:
            s = _simplify_top(d)
        got = int(s) if s.is_Integer else s
        if len(_SIMPLIFIED) > 1 << 15:
            _SIMPLIFIED.clear()
        _SIMPLIFIED[d] = got
        _SIMPLIFIED.setdefault(s, got)  # a simplified dim comes back as itself
    return got


def _simplify_top(d: sympy.Expr) -> sympy.Expr:
    return sympy.simplify(d) if isinstance(d, sympy.Expr) and not d.is_Atom else d


_SIMPLIFIED: dict[sympy.Expr, Dim] = {}


def dim_str(d: Dim) -> str:
    return "?" if d is None else str(d)


def dim_from_str(s: str, known: dict[str, sympy.Expr] | None = None) -> Dim:
    """Inverse of :func:`dim_str` for names and expressions kiln wrote itself."""
    if s == "?":
        return None
    if s.lstrip("-").isdigit():
        return int(s)
    if known and s in known:
        return known[s]
    if s.isidentifier():
        return sym(s)
    got = _PARSED.get(s)
    if got is None:
        got = _PARSED[s] = _parse_dim(s)
    return got


# dim expression -> its parse (sympy's parser takes ~4 ms a string; an engine file of a model
# with dynamic H and W repeats a few dozen expressions hundreds of times: PaddleOCR det v4
# loaded in 2.2 s, 522 parses of 27 strings)
_PARSED: dict[str, Dim] = {}


def _parse_dim(s: str) -> Dim:
    e = _parse_fast(s)
    if e is not None:
        return int(e) if e.is_Integer else e
    try:
        expr = sympy.sympify(s, locals={})
        names = {n.name: sym(n.name) for n in expr.free_symbols}
        # written simplified: no sympy.simplify here (its first call imports sympy.physics,
        # 1.5 s, and loading an engine with a few such dims took 2.4 s)
        e = expr.subs({n: names[n.name] for n in expr.free_symbols})
        return int(e) if e.is_Integer else e
    except (sympy.SympifyError, TypeError, SyntaxError):
        return sym(s)


_CALLS = {"ceiling": sympy.ceiling, "floor": sympy.floor, "Max": sympy.Max, "Min": sympy.Min,
          "Mod": sympy.Mod}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow}


def _parse_fast(s: str):
    """``s`` (integers, names, + - * / **, ceiling/floor/Max/Min/Mod: what sympy prints for
    kiln's dims) built with sympy's operators from Python's own parse, without sympify (whose
    parser took ~15 ms a string on a first load); None for anything else."""
    try:
        tree = ast.parse(s, mode="eval").body
    except SyntaxError:
        return None

    def build(n):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return sympy.Integer(n.value)
        if isinstance(n, ast.Name):
            return sym(n.id)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = build(n.operand)
            return None if v is None else (-v if isinstance(n.op, ast.USub) else v)
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            a, b = build(n.left), build(n.right)
            return None if a is None or b is None else _BINOPS[type(n.op)](a, b)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _CALLS \
                and not n.keywords:
            args = [build(a) for a in n.args]
            return None if any(a is None for a in args) else _CALLS[n.func.id](*args)
        return None

    return build(tree)


def is_static(shape: Shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


@dataclass(frozen=True)
class TensorType:
    dtype: DType | None
    shape: Shape = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def __str__(self) -> str:
        dt = self.dtype.name if self.dtype else "?"
        if self.shape is None:
            return f"{dt}[*]"
        return f"{dt}[{','.join(dim_str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class SequenceType:
    elem: Type

    def __str__(self) -> str:
        return f"seq<{self.elem}>"


@dataclass(frozen=True)
class OptionalType:
    elem: Type

    def __str__(self) -> str:
        return f"optional<{self.elem}>"


Type = Union[TensorType, SequenceType, OptionalType, None]
