"""fuse_matmul_add: MatMul(x, W const) + Add(bias) -> Gemm (2-D x) or kiln FusedMatMul (N-D x)."""

from __future__ import annotations

from kiln.ops import fused_conv as FC
from kiln.ops import nn as N
from kiln.passes.fusion.matmul_add import fuse_matmul_add
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node


def _mm_add(x_shape, bias, outputs=("y",), w_input=False, bias_first=False):
    inits = {"W": c(RNG.standard_normal((5, 4))), "b": bias}
    inputs = {"x": x_shape}
    if w_input:
        inputs["W"] = [5, 4]
        del inits["W"]
    add_ins = ["b", "t"] if bias_first else ["t", "b"]
    nodes = [node("MatMul", ["x", "W"], "t", name="mm"), node("Add", add_ins, "y", name="add")]
    return model(nodes, inputs, list(outputs), inits)


def test_fuse_matmul_add_3d_structure():
    m = _mm_add([2, 3, 5], c(RNG.standard_normal(4)))
    g, _, _, n, logs = apply(m, fuse_matmul_add, feeds(x=[2, 3, 5]))
    (f,) = g.nodes
    assert n == 1 and logs == ["fused mm + add -> FusedMatMul"]
    assert f.op is FC.FusedMatMul and f.name == "mm + add" and not f.attrs.activation
    assert f.inputs[0] is g.inputs[0] and f.inputs[1].name == "W"
    assert f.inputs[2].const.shape == (4,) and f.outputs[0] is g.outputs[0]
    assert "b" not in g.weights


def test_fuse_matmul_add_2d_counts_gemm():
    m = _mm_add([3, 5], c(RNG.standard_normal((1, 4))), bias_first=True)
    g, before, after, _, _ = apply(m, fuse_matmul_add, feeds(x=[3, 5]))
    assert before == {"Add": 1, "MatMul": 1} and after == {"Gemm": 1}
    assert g.nodes[0].op is N.Gemm and g.nodes[0].inputs[2].const.shape == (4,)


def test_fuse_matmul_add_symbolic_batch_numerics():
    m = _mm_add(["batch", "seq", 5], c(RNG.standard_normal((1, 1, 4))))
    _, _, after, _, _ = apply(m, fuse_matmul_add, feeds(x=[3, 7, 5]))  # checks outputs
    assert after == {"FusedMatMul": 1}


def test_no_fuse_matmul_add_bias_broadcasts_over_rows():
    m = _mm_add([2, 3, 5], c(RNG.standard_normal((3, 4))))
    _, before, after, n, _ = apply(m, fuse_matmul_add, feeds(x=[2, 3, 5]))
    assert n == 0 and before == after


def test_no_fuse_matmul_add_bias_raises_rank():
    m = _mm_add([3, 5], c(RNG.standard_normal((1, 1, 4))))  # output becomes [1, 3, 4]
    _, before, after, n, _ = apply(m, fuse_matmul_add, feeds(x=[3, 5]))
    assert n == 0 and before == after


def test_no_fuse_matmul_add_weight_not_constant():
    m = _mm_add([2, 3, 5], c(RNG.standard_normal(4)), w_input=True)
    _, before, after, n, _ = apply(m, fuse_matmul_add, feeds(x=[2, 3, 5], W=[5, 4]))
    assert n == 0 and before == after


def test_no_fuse_matmul_add_product_is_graph_output():
    m = _mm_add([2, 3, 5], c(RNG.standard_normal(4)), outputs=("y", "t"))
    _, before, after, n, _ = apply(m, fuse_matmul_add, feeds(x=[2, 3, 5]))
    assert n == 0 and before == after
