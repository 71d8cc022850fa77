import numpy as np

from kiln.ops import nn as N
from kiln.passes.fusion.layernorm import fuse_layernorm
from tests.passes.transformer_util import apply, c, feeds, model, node

D = 16


def ln_nodes(square="Pow", affine=True, div="Div"):
    ns = [node("ReduceMean", ["x"], "mu", axes=[-1]),
          node("Sub", ["x", "mu"], "d"),
          node("Pow", ["d", "two"], "sq") if square == "Pow" else node("Mul", ["d", "d"], "sq"),
          node("ReduceMean", ["sq"], "var", axes=[-1]),
          node("Add", ["var", "eps"], "ve"),
          node("Sqrt", ["ve"], "sd")]
    if div == "Div":
        ns.append(node("Div", ["d", "sd"], "n"))
    else:
        ns += [node("Reciprocal", ["sd"], "r"), node("Mul", ["d", "r"], "n")]
    if affine:
        ns += [node("Mul", ["n", "g"], "ng"), node("Add", ["ng", "b"], "y")]
    else:
        ns.append(node("Identity", ["n"], "y"))
    return ns


INITS = {"two": c(2.0), "eps": c(1e-5), "g": c(np.linspace(0.5, 1.5, D)),
         "b": c(np.linspace(-1, 1, D))}


def test_layernorm_structure_counts_numerics():
    m = model(ln_nodes(), {"x": ["n", 5, D]}, ["y"], INITS)
    g, before, after, n, logs = apply(m, fuse_layernorm, feeds(x=(2, 5, D)))
    assert n == 1 and after == {"LayerNormalization": 1}
    assert before["ReduceMean"] == 2 and before["Sub"] == 1
    (ln,) = g.nodes
    assert ln.op is N.LayerNormalization and ln.inputs[0] is g.inputs[0]
    assert ln.outputs[0] is g.outputs[0] and ln.attrs.axis == 2
    assert abs(ln.attrs.epsilon - 1e-5) < 1e-12
    np.testing.assert_allclose(ln.inputs[1].const, INITS["g"])
    assert ln.name == "mu + d + sq + var + ve + sd + n + ng + y"
    assert logs == [f"fused {ln.name} -> LayerNormalization"]


def test_layernorm_mul_square_reciprocal_no_affine():
    m = model(ln_nodes("Mul", affine=False, div="Mul"), {"x": [3, D]}, ["y"], INITS)
    g, _, after, n, _ = apply(m, fuse_layernorm, feeds(x=(3, D)))
    assert n == 1 and after == {"Identity": 1, "LayerNormalization": 1}
    ln = g.nodes[0]
    assert len(ln.inputs) == 2 and np.all(ln.inputs[1].const == 1)


def test_no_fuse_layernorm_shared_intermediate():
    # the variance is also a graph output: the fused node could not produce it
    m = model(ln_nodes(), {"x": [3, D]}, ["y", "var"], INITS)
    _, before, after, n, _ = apply(m, fuse_layernorm, feeds(x=(3, D)))
    assert n == 0 and before == after


def test_no_fuse_layernorm_mismatched_axes():
    ns = ln_nodes()
    ns[3] = node("ReduceMean", ["sq"], "var", axes=[0])  # variance over another axis
    m = model(ns, {"x": [D, D]}, ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_layernorm, feeds(x=(D, D)))
    assert n == 0 and before == after


def test_no_fuse_layernorm_non_constant_gamma():
    m = model(ln_nodes(), {"x": [3, D], "g": [D]}, ["y"],
              {k: v for k, v in INITS.items() if k != "g"})
    g, _, after, n, _ = apply(m, fuse_layernorm, feeds(x=(3, D), g=(D,)))
    # the normalization still fuses; the runtime gamma stays a Mul after it
    assert n == 1 and after == {"Add": 1, "LayerNormalization": 1, "Mul": 1}
    assert all(x == 1 for x in g.nodes[0].inputs[1].const)
