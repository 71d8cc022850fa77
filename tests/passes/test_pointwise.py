import json

import numpy as np

from kiln.ops import fused_transformer as FT
from kiln.passes.fusion.pointwise import fuse_pointwise
from tests.passes.transformer_util import apply, c, feeds, model, node

INITS = {"one": c(1.0), "big": c(-10000.0), "bias": c(np.linspace(-1, 1, 8))}


def test_pointwise_structure_counts_numerics():
    ns = [node("Sub", ["one", "a"], "t"), node("Mul", ["t", "big"], "u"),
          node("Add", ["u", "bias"], "w"), node("Tanh", ["w"], "y")]
    m = model(ns, {"a": ["n", 8]}, ["y"], INITS)
    g, before, after, n, logs = apply(m, fuse_pointwise, feeds(a=(3, 8)))
    assert n == 1 and before == {"Add": 1, "Mul": 1, "Sub": 1, "Tanh": 1}
    assert after == {"FusedPointwise": 1}
    (fp,) = g.nodes
    assert fp.op is FT.FusedPointwise and fp.outputs[0] is g.outputs[0]
    assert json.loads(fp.attrs.program) == [["Sub", ["i0", "i1"]], ["Mul", ["s0", "i2"]],
                                            ["Add", ["s1", "i3"]], ["Tanh", ["s2"]]]
    assert fp.inputs[1] is g.inputs[0] and fp.name == "t + u + w + y"
    assert logs == [f"fused {fp.name} -> FusedPointwise[Sub, Mul, Add, Tanh]"]


def test_no_fuse_pointwise_shared_intermediate():
    ns = [node("Sub", ["one", "a"], "t"), node("Mul", ["t", "big"], "y")]
    m = model(ns, {"a": [3, 8]}, ["y", "t"], INITS)  # t is also an output
    _, before, after, n, _ = apply(m, fuse_pointwise, feeds(a=(3, 8)))
    assert n == 0 and before == after


def test_no_fuse_pointwise_broadcast_grows_shape():
    ns = [node("Neg", ["a"], "t"), node("Add", ["t", "b"], "y")]  # [8] + [3, 8] -> [3, 8]
    m = model(ns, {"a": [8], "b": [3, 8]}, ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_pointwise, feeds(a=(8,), b=(3, 8)))
    assert n == 0 and before == after
