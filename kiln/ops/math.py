"""Elementwise math: arithmetic, comparisons, logic, bitwise and activations."""

from __future__ import annotations

import sympy

from kiln.ir import DType
from kiln.ir.opdef import InferCtx
from kiln.ir.types import as_dim
from kiln.ops.rules import broadcast, broadcast_shapes, same, same_shape, tensor
from kiln.ops.schema import onnx_op

_INT_DTYPES = (DType.int64, DType.int32, DType.int16, DType.int8, DType.uint8, DType.uint16,
               DType.uint32, DType.uint64)


_SYM_MAX = 64  # longest int vector treated as shape arithmetic


def _int_div(a, b):
    """Integer Div as the kernel computes it: truncation toward zero. Symbolic dims are
    non-negative, where floor and truncation agree."""
    if isinstance(a, int) and isinstance(b, int):
        if b == 0:
            return None
        q = abs(a) // abs(b)
        return q if (a < 0) == (b < 0) else -q
    return sympy.floor(a / b)


_SYM_FNS = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "Div": _int_div,
    "Max": lambda a, b: max(a, b) if isinstance(a, int) and isinstance(b, int) else sympy.Max(a, b),
    "Min": lambda a, b: min(a, b) if isinstance(a, int) and isinstance(b, int) else sympy.Min(a, b),
}


def _sym_elementwise(fn, xs: tuple, ys: tuple) -> tuple | None:
    """Elementwise ``fn`` over two symbolic int vectors, with size-1 broadcasting."""
    if len(xs) != len(ys) and 1 not in (len(xs), len(ys)) or max(len(xs), len(ys)) > _SYM_MAX:
        return None  # not broadcastable, or data rather than a shape
    n = max(len(xs), len(ys))
    xs = xs * n if len(xs) == 1 else xs
    ys = ys * n if len(ys) == 1 else ys
    out = []
    for a, b in zip(xs, ys):
        if a is None or b is None:
            out.append(None)
            continue
        r = fn(a, b)
        out.append(None if r is None else as_dim(r))
    return tuple(out)


def _arith(name: str):
    """Broadcast rule that also publishes shape arithmetic on symbolic int vectors (e.g.
    ``Shape(x)[0] * 2``) so Reshape and friends downstream see symbolic dims."""
    base = broadcast()
    fn = _SYM_FNS[name]

    def rule(ctx: InferCtx):
        out = base(ctx)
        n_in = len(ctx.in_types)
        if ctx.dtype(0) not in _INT_DTYPES or n_in < 2:
            return out
        syms = ctx.sym(0)
        for i in range(1, n_in):  # Max/Min are variadic
            ys = ctx.sym(i)
            syms = None if syms is None or ys is None else _sym_elementwise(fn, syms, ys)
        if syms is not None:
            ctx.out_syms = [syms]
        return out
    return rule


def _where(ctx: InferCtx):
    shapes = [ctx.shape(i) for i in range(3)]
    return [tensor(ctx.dtype(1), broadcast_shapes(*shapes))]


# arithmetic
Add = onnx_op("Add", _arith("Add"))
Sub = onnx_op("Sub", _arith("Sub"))
Mul = onnx_op("Mul", _arith("Mul"))
Div = onnx_op("Div", _arith("Div"))
Mod = onnx_op("Mod", broadcast())
Pow = onnx_op("Pow", broadcast())  # result has the base's dtype
Max = onnx_op("Max", _arith("Max"))
Min = onnx_op("Min", _arith("Min"))
Sum = onnx_op("Sum", broadcast())
Mean = onnx_op("Mean", broadcast())
Where = onnx_op("Where", _where)
Clip = onnx_op("Clip", same())

# unary math
Neg = onnx_op("Neg", same())
Abs = onnx_op("Abs", same())
Reciprocal = onnx_op("Reciprocal", same())
Sqrt = onnx_op("Sqrt", same())
Exp = onnx_op("Exp", same())
Log = onnx_op("Log", same())
Ceil = onnx_op("Ceil", same())
Floor = onnx_op("Floor", same())
Round = onnx_op("Round", same())
Sign = onnx_op("Sign", same())
Erf = onnx_op("Erf", same())
Sin = onnx_op("Sin", same())
Cos = onnx_op("Cos", same())
Tan = onnx_op("Tan", same())
Asin = onnx_op("Asin", same())
Acos = onnx_op("Acos", same())
Atan = onnx_op("Atan", same())
Sinh = onnx_op("Sinh", same())
Cosh = onnx_op("Cosh", same())
Asinh = onnx_op("Asinh", same())
Acosh = onnx_op("Acosh", same())
Atanh = onnx_op("Atanh", same())
Tanh = onnx_op("Tanh", same())
IsNaN = onnx_op("IsNaN", same_shape(DType.bool))
IsInf = onnx_op("IsInf", same_shape(DType.bool))

# comparisons and logic
Equal = onnx_op("Equal", broadcast(DType.bool))
Less = onnx_op("Less", broadcast(DType.bool))
LessOrEqual = onnx_op("LessOrEqual", broadcast(DType.bool))
Greater = onnx_op("Greater", broadcast(DType.bool))
GreaterOrEqual = onnx_op("GreaterOrEqual", broadcast(DType.bool))
And = onnx_op("And", broadcast(DType.bool))
Or = onnx_op("Or", broadcast(DType.bool))
Xor = onnx_op("Xor", broadcast(DType.bool))
Not = onnx_op("Not", same())

# bitwise
BitShift = onnx_op("BitShift", broadcast())
BitwiseAnd = onnx_op("BitwiseAnd", broadcast())
BitwiseOr = onnx_op("BitwiseOr", broadcast())
BitwiseXor = onnx_op("BitwiseXor", broadcast())
BitwiseNot = onnx_op("BitwiseNot", same())

# activations
Relu = onnx_op("Relu", same())
LeakyRelu = onnx_op("LeakyRelu", same())
PRelu = onnx_op("PRelu", same())  # the slope broadcasts to X (unidirectionally)
Elu = onnx_op("Elu", same())
Selu = onnx_op("Selu", same())
Celu = onnx_op("Celu", same())
Sigmoid = onnx_op("Sigmoid", same())
HardSigmoid = onnx_op("HardSigmoid", same())
HardSwish = onnx_op("HardSwish", same())
Softplus = onnx_op("Softplus", same())
Softsign = onnx_op("Softsign", same())
ThresholdedRelu = onnx_op("ThresholdedRelu", same())
Shrink = onnx_op("Shrink", same())
Gelu = onnx_op("Gelu", same())
Mish = onnx_op("Mish", same())
Swish = onnx_op("Swish", same())
