"""Unit tests for the elementwise math family (kiln/ops/math.py + kernels/torch/math*.py)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

from kiln.errors import KernelError
from kiln.ir import DType, InferCtx
from kiln.ir.types import sym
from kiln.ops import math as M
from kiln.ops.rules import tensor
from tests.ops.harness import (
    assert_close,
    check_against_reference,
    node_model,
    run_kiln,
    run_reference,
)

RNG = np.random.default_rng(0)


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean"])
def test_binary_float_broadcast(op):
    inputs = {"a": _f32(2, 3, 4), "b": _f32(3, 1) + 3.0}
    check_against_reference(node_model(op, inputs), inputs)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.uint64])
@pytest.mark.parametrize("op", ["Add", "Sub", "Div", "Max", "Less", "Equal"])
def test_binary_int(op, dtype):
    a = RNG.integers(0, 100, (3, 4)).astype(dtype)
    b = RNG.integers(1, 10, (4,)).astype(dtype)
    inputs = {"a": a, "b": b}
    check_against_reference(node_model(op, inputs), inputs)


def test_div_int_truncates_toward_zero():
    inputs = {"a": np.array([-3, 3, -3, 3, -7], np.int32), "b": np.array([2, 2, -2, -2, 7],
                                                                          np.int32)}
    (got,) = run_kiln(node_model("Div", inputs), inputs)
    np.testing.assert_array_equal(got, np.array([-1, 1, 1, -1, -1], np.int32))


def test_uint64_order_above_2_63():
    big = np.array([2**64 - 1, 5, 2**63], np.uint64)
    small = np.array([1, 2**63 + 1, 2**63], np.uint64)
    inputs = {"a": big, "b": small}
    for op in ("Greater", "Max", "Div"):
        check_against_reference(node_model(op, inputs), inputs)


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_mod(fmod, dtype):
    if fmod == 0 and dtype == np.float32:
        inputs = {"a": np.array([-4.5, 7, 5, -0.0, 3], dtype),
                  "b": np.array([2, -3, 8, 2, np.inf], dtype)}
        (got,) = run_kiln(node_model("Mod", inputs, fmod=fmod), inputs)
        assert_close(got, np.mod(inputs["a"], inputs["b"]))
        return
    inputs = {"a": np.array([-4, 7, 5, 4, -7], dtype), "b": np.array([2, -3, 8, -3, 3], dtype)}
    check_against_reference(node_model("Mod", inputs, fmod=fmod), inputs)


@pytest.mark.parametrize("types", [(np.float32, np.int64), (np.int32, np.float32),
                                   (np.int64, np.int64), (np.float32, np.uint32)])
def test_pow_mixed_types(types):
    inputs = {"x": np.array([1, 2, 3], types[0]), "y": np.array([4, 5, 6], types[1])}
    (got,) = run_kiln(node_model("Pow", inputs), inputs)
    assert got.dtype == types[0]
    np.testing.assert_allclose(got, np.power(inputs["x"].astype(np.float64),
                                             inputs["y"].astype(np.float64)).astype(types[0]))


@pytest.mark.parametrize("op", [
    "Neg", "Abs", "Reciprocal", "Exp", "Ceil", "Floor", "Round", "Sign", "Erf", "Sin", "Cos",
    "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Tanh", "Relu", "Sigmoid", "HardSigmoid",
    "HardSwish", "Softplus", "Softsign", "Elu", "Selu", "Celu", "LeakyRelu",
    "ThresholdedRelu", "Mish", "IsNaN", "IsInf"])
def test_unary_float(op):
    inputs = {"x": np.array([-2.5, -0.5, 0.0, 0.5, 1.5, 2.5, 3.7], np.float32)}
    check_against_reference(node_model(op, inputs), inputs)


@pytest.mark.parametrize("op", ["Sqrt", "Log", "Asin", "Acos", "Acosh", "Atanh"])
def test_unary_domain(op):
    x = np.array([0.1, 0.5, 0.9], np.float32) + (1.0 if op == "Acosh" else 0.0)
    check_against_reference(node_model(op, {"x": x}), {"x": x})


def test_gelu_and_swish():
    inputs = {"x": _f32(3, 5)}
    check_against_reference(node_model("Gelu", inputs), inputs)
    check_against_reference(node_model("Gelu", inputs, approximate="tanh"), inputs)
    (got,) = run_kiln(node_model("Swish", inputs, alpha=0.5), inputs)
    x = inputs["x"]
    assert_close(got, (x / (1 + np.exp(-0.5 * x))).astype(np.float32))


def test_shrink_and_prelu():
    x = np.array([-2.0, -1.0, -0.2, 0.0, 0.4, 1.0, 2.0], np.float32)
    check_against_reference(node_model("Shrink", {"x": x}, lambd=0.5, bias=0.25), {"x": x})
    inputs = {"x": _f32(2, 3, 4), "slope": np.abs(_f32(3, 1))}
    check_against_reference(node_model("PRelu", inputs), inputs)


def test_logic_and_bitwise():
    a, b = RNG.random((3, 4)) > 0.5, RNG.random((4,)) > 0.5
    for op in ("And", "Or", "Xor"):
        check_against_reference(node_model(op, {"a": a, "b": b}), {"a": a, "b": b})
    check_against_reference(node_model("Not", {"a": a}), {"a": a})
    x, y = np.array([5, 12, 255], np.uint16), np.array([3, 10, 1], np.uint16)
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        check_against_reference(node_model(op, {"x": x, "y": y}), {"x": x, "y": y})
    check_against_reference(node_model("BitwiseNot", {"x": x}), {"x": x})


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift_out_of_range(direction):
    inputs = {"x": np.array([-8, 4, -1, 64], np.int8), "y": np.array([8, -1, 100, 1], np.int8)}
    (got,) = run_kiln(node_model("BitShift", inputs, direction=direction), inputs)
    want = [0, 0, 0, -128] if direction == "LEFT" else [-1, 0, -1, 32]
    np.testing.assert_array_equal(got, np.array(want, np.int8))


def test_where_and_clip():
    inputs = {"c": RNG.random((2, 3)) > 0.5, "x": _f32(2, 3), "y": _f32(3)}
    check_against_reference(node_model("Where", inputs), inputs)
    clip = {"x": _f32(4, 4), "lo": np.array(-0.5, np.float32), "hi": np.array(0.3, np.float32)}
    check_against_reference(node_model("Clip", clip), clip)
    x = {"x": np.array([-100, 0, 100], np.int8)}
    (got,) = run_kiln(node_model("Clip", x), x)  # no bounds: identity, dtype kept
    assert_close(got, x["x"])


def test_clip_attributes_before_opset_11():
    x = {"x": np.array([-3.0, 0.2, 3.0], np.float32)}
    model = node_model("Clip", x, opset=6, min=-1.0, max=1.0)
    (got,) = run_kiln(model, x)
    assert_close(got, np.array([-1.0, 0.2, 1.0], np.float32))


def test_legacy_broadcast_axis():
    """Opset 6 Add with broadcast=1 aligns B with A at ``axis`` (not numpy-style)."""
    inputs = {"a": _f32(2, 3, 4), "b": _f32(3)}
    (got,) = run_kiln(node_model("Add", inputs, opset=6, broadcast=1, axis=1), inputs)
    assert_close(got, inputs["a"] + inputs["b"][:, None])


def test_equal_strings():
    inputs = {"a": np.array(["a", "b", "c"], dtype=object), "b": np.array(["a"], dtype=object)}
    (got,) = run_kiln(node_model("Equal", inputs), inputs)
    np.testing.assert_array_equal(got, [True, False, False])


def test_isinf_flags():
    x = {"x": np.array([-np.inf, 0.0, np.inf, np.nan], np.float32)}
    for pos, neg in ((1, 0), (0, 1)):
        model = node_model("IsInf", x, detect_positive=pos, detect_negative=neg)
        assert_close(run_kiln(model, x)[0], run_reference(model, x)[0])


def _sym_ctx(op, xs, ys):
    ctx = InferCtx(op.make_attrs(), [tensor(DType.int64, (len(xs),)),
                                     tensor(DType.int64, (len(ys),))],
                   [None, None], [xs, ys], 1)
    types = op.infer(ctx)
    return types[0], ctx.out_syms[0] if ctx.out_syms else None


def test_shape_arithmetic_publishes_symbols():
    """Shape(x) * 2 / 2 + 1 keeps symbolic dims (batch) for shape consumers downstream."""
    b = sym("batch")
    t, m = _sym_ctx(M.Mul, (b, 3), (2,))
    assert t.dtype == DType.int64 and t.shape == (2,)
    assert m == (2 * b, 6)
    _, d = _sym_ctx(M.Div, m, (2,))
    assert sympy.simplify(d[0] - b) == 0 and d[1] == 3
    _, a = _sym_ctx(M.Add, d, (1, None))
    assert a[1] is None and sympy.simplify(a[0] - b - 1) == 0
    _, s = _sym_ctx(M.Sub, (b, 7), (b, 2))
    assert s == (0, 5)
    _, mx = _sym_ctx(M.Max, (b, 7), (1, 9))
    assert mx[1] == 9 and sympy.simplify(mx[0] - sympy.Max(b, 1)) == 0


def test_bad_input_mismatched_broadcast():
    inputs = {"a": _f32(2, 3), "b": _f32(4)}
    model = node_model("Add", inputs)
    with pytest.raises((KernelError, ValueError, RuntimeError)):
        run_kiln(model, inputs)
