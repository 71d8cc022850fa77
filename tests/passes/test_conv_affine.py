"""fold_conv_mul (Conv -> Mul/Div by a per-channel constant) and fold_input_affine (a
per-channel Mul/Add map -> an unpadded Conv): structure, counts and numerics against
onnxruntime, where they must not fire, and PP-LCNetV3's affine blocks through the pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.frontend import import_onnx
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N
from kiln.passes.fusion.conv_bias import fold_conv_mul
from kiln.passes.fusion.input_affine import fold_input_affine
from kiln.passes.pipeline import optimize
from tests.passes.exports import ort_run
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node, run

C_IN, C_OUT = 3, 4
X = [2, C_IN, 6, 7]


def _typed(m):
    for o in m.graph.output:
        o.type.tensor_type.elem_type = 1
    return m


def _conv_mul(op="Mul", shape=(1, C_OUT, 1, 1), bias=True, conv_first=True, outputs=("y",),
              value=None):
    k = RNG.uniform(0.5, 2.0, shape) if value is None else np.full(shape, value)
    inits = {"W": c(RNG.standard_normal((C_OUT, C_IN, 3, 3))), "k": c(k)}
    conv_ins = ["x", "W"]
    if bias:
        inits["B"] = c(RNG.standard_normal(C_OUT))
        conv_ins.append("B")
    ins = ["t", "k"] if conv_first else ["k", "t"]
    nodes = [node("Conv", conv_ins, "t", name="conv", pads=[1, 1, 1, 1]),
             node(op, ins, "y", name="mul")]
    return _typed(model(nodes, {"x": X}, list(outputs), inits)), inits


@pytest.mark.parametrize("op,shape,bias,conv_first", [
    ("Mul", (1, C_OUT, 1, 1), True, True),
    ("Mul", (C_OUT, 1, 1), False, False),  # constant first, no bias
    ("Mul", (1,), True, False),            # Paddle's scalar factor
    ("Div", (1, C_OUT, 1, 1), True, True),
])
def test_fold_conv_mul_structure_counts_numerics(op, shape, bias, conv_first):
    m, inits = _conv_mul(op, shape, bias, conv_first)
    f = feeds(x=X)
    g, before, after, n, logs = apply(m, fold_conv_mul, f, atol=1e-5)
    assert n == 1 and logs == ["fused conv + mul -> Conv"]
    assert before == {"Conv": 1, op: 1} and after == {"Conv": 1}
    (conv,) = g.nodes
    assert conv.op is N.Conv and conv.inputs[0] is g.inputs[0] and conv.outputs[0] is g.outputs[0]
    k = np.broadcast_to(inits["k"].reshape(-1), (C_OUT,)).astype(np.float64)
    k = 1 / k if op == "Div" else k
    np.testing.assert_allclose(conv.inputs[1].const, inits["W"] * k.reshape(-1, 1, 1, 1),
                               rtol=1e-6)
    if bias:
        np.testing.assert_allclose(conv.inputs[2].const, inits["B"] * k, rtol=1e-6)
    else:
        assert len(conv.inputs) == 2
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["spatial", "constant_over_conv", "read_twice", "div_zero",
                                  "infinite"])
def test_no_fold_conv_mul(case):
    if case == "spatial":  # a factor that varies over H and W is no per-channel scale
        m, _ = _conv_mul(shape=(1, C_OUT, 6, 7))
    elif case == "constant_over_conv":  # k / conv
        m, _ = _conv_mul("Div", conv_first=False)
    elif case == "read_twice":
        m, _ = _conv_mul(outputs=("y", "t"))
    elif case == "div_zero":
        m, _ = _conv_mul("Div", shape=(1,), value=0.0)
    else:
        m, _ = _conv_mul(shape=(1,), value=np.inf)
    g = import_onnx(m)
    before = g.op_counts()
    assert fold_conv_mul(g, lambda s: None) == 0 and g.op_counts() == before


def _affine_conv(ops=("Mul", "Add"), shape=(1, C_IN, 1, 1), kernel=1, pads=0, group=1,
                 outputs=("y",), x_second=False, bias=True):
    """x -> [Mul(s)] -> [Add(t)] -> Conv(kernel, pads, group) -> y."""
    inits = {"W": c(RNG.standard_normal((C_OUT, C_IN // group, kernel, kernel)))}
    if bias:
        inits["B"] = c(RNG.standard_normal(C_OUT))
    nodes, cur = [], "x"
    for i, op in enumerate(ops):
        k = f"k{i}"
        inits[k] = c(RNG.uniform(0.5, 2.0, shape) if op in ("Mul", "Div")
                     else RNG.standard_normal(shape))
        out = f"m{i}"
        nodes.append(node(op, [k, cur] if x_second else [cur, k], out, name=op.lower()))
        cur = out
    nodes.append(node("Conv", [cur, "W", *(["B"] if bias else [])], "y", name="conv",
                      pads=[pads] * 4, group=group))
    return _typed(model(nodes, {"x": X}, list(outputs), inits)), inits


@pytest.mark.parametrize("ops,shape,kernel,x_second,bias", [
    (("Mul", "Add"), (1, C_IN, 1, 1), 1, False, True),   # PP-LCNetV3's affine block
    (("Mul", "Add"), (1,), 1, True, False),             # scalars, constants first, no bias
    (("Add", "Mul"), (C_IN, 1, 1), 3, False, True),     # either order, an unpadded 3x3
    (("Sub",), (1, C_IN, 1, 1), 1, False, True),
    (("Div",), (1,), 2, False, True),
])
def test_fold_input_affine_structure_counts_numerics(ops, shape, kernel, x_second, bias):
    m, _ = _affine_conv(ops, shape, kernel, x_second=x_second, bias=bias)
    f = feeds(x=X)
    g, before, after, n, logs = apply(m, fold_input_affine, f, atol=1e-4)
    assert n == len(ops) and after == {"Conv": 1}
    assert before == {"Conv": 1, **{op: ops.count(op) for op in ops}}
    (conv,) = g.nodes
    assert conv.op is N.Conv and conv.inputs[0] is g.inputs[0]
    assert logs[0] == f"fused {ops[-1].lower()} + conv -> Conv"
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["padded", "grouped", "spatial", "read_twice", "minus_x",
                                  "over_x"])
def test_no_fold_input_affine(case):
    if case == "padded":  # the border would read zeros, not the mapped zeros
        m, _ = _affine_conv(kernel=3, pads=1)
    elif case == "grouped":
        m, _ = _affine_conv(group=C_IN, shape=(1,))
    elif case == "spatial":
        m, _ = _affine_conv(shape=(1, C_IN, 6, 7))
    elif case == "read_twice":  # the map's result is an output too
        m, _ = _affine_conv(ops=("Add",), outputs=("y", "m0"))
    elif case == "minus_x":  # t - x
        m, _ = _affine_conv(ops=("Sub",), x_second=True)
    else:  # s / x
        m, _ = _affine_conv(ops=("Div",), x_second=True)
    g = import_onnx(m)
    before = g.op_counts()
    assert fold_input_affine(g, lambda s: None) == 0 and g.op_counts() == before


def test_lcnet_affine_blocks_fold_through_the_pipeline():
    """PP-LCNetV3: Conv -> Mul(a) -> Add(b) -> HardSwish (Add 3, Clip, Mul, Div 6) -> Mul(c)
    -> Add(d) -> 1x1 Conv -> Mul(e) -> Add(f): two FusedConvs (the first with its HardSwish),
    nothing loose."""
    ch = 8
    s = {k: c(RNG.uniform(0.5, 1.5, (1,))) for k in "aceg"}
    s.update({k: c(RNG.standard_normal((1,))) for k in "bdfh"})
    inits = {"W1": c(RNG.standard_normal((ch, C_IN, 3, 3))), "B1": c(RNG.standard_normal(ch)),
             "W2": c(RNG.standard_normal((C_OUT, ch, 1, 1))), "three": c([3.0]),
             "zero": c(0.0), "six": c(6.0), **s}
    nodes = [node("Conv", ["x", "W1", "B1"], "c1", pads=[1, 1, 1, 1]),
             node("Mul", ["a", "c1"], "m1"), node("Add", ["m1", "b"], "a1"),
             node("Add", ["a1", "three"], "h1"), node("Clip", ["h1", "zero", "six"], "h2"),
             node("Mul", ["a1", "h2"], "h3"), node("Div", ["h3", "six"], "h4"),
             node("Mul", ["c", "h4"], "m2"), node("Add", ["m2", "d"], "a2"),
             node("Conv", ["a2", "W2"], "c2"), node("Mul", ["e", "c2"], "m3"),
             node("Add", ["m3", "f"], "y")]
    m = _typed(model(nodes, {"x": X}, ["y"], inits, opset=13))
    g = optimize(import_onnx(m))
    assert [n.op for n in g.nodes] == [FC.FusedConv, FC.FusedConv]
    assert g.nodes[0].attrs.activation == "HardSwish" and not g.nodes[1].attrs.activation
    f = feeds(x=X)
    np.testing.assert_allclose(run(g, f)[0], ort_run(m, f)[0], rtol=1e-4, atol=1e-4)
