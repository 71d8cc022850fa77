import json

import numpy as np

from kiln.frontend import import_onnx
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


def _mask_model():
    """HF's SDPA mask: a key-padding and a query-padding mask (here from comparisons) combined
    by And over [B, 1, Sq, Sk], then Where(mask, 0, -10000)."""
    inits = {"zero": c(0.0), "neg": c(-10000.0)}
    ns = [node("Greater", ["a", "zero"], "k"), node("Greater", ["b", "zero"], "q"),
          node("And", ["q", "k"], "m"), node("Where", ["m", "zero", "neg"], "y")]
    return model(ns, {"a": [2, 1, 1, 8], "b": [2, 1, 8, 1]}, ["y"], inits)


def test_pointwise_masks_structure_counts_numerics():
    from kiln.passes.fusion.pointwise import fuse_pointwise_masks

    g, before, after, n, logs = apply(_mask_model(), fuse_pointwise_masks,
                                      feeds(a=(2, 1, 1, 8), b=(2, 1, 8, 1)))
    assert n == 1 and before == {"Greater": 2, "And": 1, "Where": 1}
    # the Greaters widen into And's [2, 1, 8, 8]: no chain runs through a broadcast
    assert after == {"Greater": 2, "FusedPointwise": 1}
    fp = next(x for x in g.nodes if x.op is FT.FusedPointwise)
    assert json.loads(fp.attrs.program) == [["And", ["i0", "i1"]],
                                            ["Where", ["s0", "i2", "i3"]]]
    assert logs == [f"fused {fp.name} -> FusedPointwise[And, Where]"]


def test_no_fuse_pointwise_masks_outside_cuda_builds():
    """The CPU pipeline's pass leaves the mask steps alone (its pointwise records run float
    programs); the CUDA pipeline uses the mask-taking pass."""
    from kiln.passes.pipeline import _passes

    _, before, after, n, _ = apply(_mask_model(), fuse_pointwise,
                                   feeds(a=(2, 1, 1, 8), b=(2, 1, 8, 1)))
    assert n == 0 and before == after
    cuda = dict(_passes("cuda"))["fuse_pointwise"]
    cpu = dict(_passes("cpu"))["fuse_pointwise"]
    g = import_onnx(_mask_model())
    assert cpu(g, lambda m: None) == 0 and cuda(g, lambda m: None) == 1
