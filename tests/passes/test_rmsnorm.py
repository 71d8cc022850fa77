import numpy as np

from kiln.ops import nn as N
from kiln.passes.fusion.rmsnorm import fuse_rmsnorm
from tests.passes.transformer_util import apply, c, feeds, model, node

D = 16
INITS = {"two": c(2.0), "eps": c(1e-6), "g": c(np.linspace(0.5, 1.5, D))}


def rms_nodes(square="Pow", recip=True):
    ns = [node("Pow", ["x", "two"], "sq") if square == "Pow" else node("Mul", ["x", "x"], "sq"),
          node("ReduceMean", ["sq"], "ms", axes=[-1]),
          node("Add", ["ms", "eps"], "mse"),
          node("Sqrt", ["mse"], "rms")]
    if recip:
        ns += [node("Reciprocal", ["rms"], "inv"), node("Mul", ["x", "inv"], "n")]
    else:
        ns.append(node("Div", ["x", "rms"], "n"))
    return ns + [node("Mul", ["g", "n"], "y")]


def test_rmsnorm_structure_counts_numerics():
    m = model(rms_nodes(), {"x": ["n", 4, D]}, ["y"], INITS)
    g, before, after, n, logs = apply(m, fuse_rmsnorm, feeds(x=(2, 4, D)))
    assert n == 1 and after == {"RMSNormalization": 1}
    assert before == {"Add": 1, "Mul": 2, "Pow": 1, "ReduceMean": 1, "Reciprocal": 1,
                      "Sqrt": 1}
    (rn,) = g.nodes
    assert rn.op is N.RMSNormalization and rn.inputs[0] is g.inputs[0]
    assert rn.attrs.axis == 2 and abs(rn.attrs.epsilon - 1e-6) < 1e-12
    np.testing.assert_allclose(rn.inputs[1].const, INITS["g"])
    assert logs == [f"fused {rn.name} -> RMSNormalization"]


def test_rmsnorm_mul_square_div():
    m = model(rms_nodes("Mul", recip=False), {"x": [3, D]}, ["y"], INITS)
    _, _, after, n, _ = apply(m, fuse_rmsnorm, feeds(x=(3, D)))
    assert n == 1 and after == {"RMSNormalization": 1}


def test_no_fuse_rmsnorm_square_of_other_tensor():
    ns = rms_nodes()
    ns[0] = node("Pow", ["z", "two"], "sq")  # the mean square of z normalizes x: not RMSNorm
    m = model(ns, {"x": [3, D], "z": [3, D]}, ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_rmsnorm, feeds(x=(3, D), z=(3, D)))
    assert n == 0 and before == after


def test_no_fuse_rmsnorm_not_last_axis():
    ns = rms_nodes()
    ns[1] = node("ReduceMean", ["sq"], "ms", axes=[0])
    m = model(ns, {"x": [D, D]}, ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_rmsnorm, feeds(x=(D, D)))
    assert n == 0 and before == after


def rsqrt_nodes(numerator="one"):
    """transformers' LlamaRMSNorm as torch.onnx writes it: x * Div(1, Sqrt(mean(x²) + eps))."""
    ns = rms_nodes()[:4]
    return ns + [node("Div", [numerator, "rms"], "inv"), node("Mul", ["x", "inv"], "n"),
                 node("Mul", ["g", "n"], "y")]


def test_rmsnorm_one_over_sigma():
    inits = dict(INITS, one=c(1.0))
    m = model(rsqrt_nodes(), {"x": ["n", 4, D]}, ["y"], inits)
    g, before, after, n, _ = apply(m, fuse_rmsnorm, feeds(x=(2, 4, D)))
    assert n == 1 and after == {"RMSNormalization": 1}
    assert before == {"Add": 1, "Div": 1, "Mul": 2, "Pow": 1, "ReduceMean": 1, "Sqrt": 1}
    (rn,) = g.nodes
    assert rn.inputs[0] is g.inputs[0] and abs(rn.attrs.epsilon - 1e-6) < 1e-12


def test_no_fuse_rmsnorm_two_over_sigma():
    inits = dict(INITS, two_n=c(2.0))  # 2 / σ scales the result: not RMSNorm's 1 / σ
    m = model(rsqrt_nodes("two_n"), {"x": [3, D]}, ["y"], inits)
    _, before, after, n, _ = apply(m, fuse_rmsnorm, feeds(x=(3, D)))
    assert n == 0 and before == after
