"""fold_pad_conv on real exports: the TF "same" padding CNN (once its profile is fixed) and
F.pad before a conv or pool, tested for structure, counts and numerics, and where it must not
fire."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.engine.profile import Profile
from kiln.frontend import fixed_dims, import_onnx
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.pad_conv import fold_pad_conv
from kiln.passes.pipeline import optimize
from kiln.passes.verifier import verify
from tests.passes.exports import ort_run, pad_then, same_pad_cnn
from tests.passes.transformer_util import run

FOLDING = {"fold_to_fixed_point", "fold_constants", "fold_shape_inputs", "remove_noops",
           "merge_common_nodes", "remove_dead_nodes"}


def _fold(data: bytes, shape):
    g = import_onnx(data, fixed=fixed_dims([Profile.fixed({"x": shape})]))
    optimize(g, only=FOLDING)
    f = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    before, ref, logs = g.op_counts(), run(g, f), []
    n = fold_pad_conv(g, logs.append)
    verify(g, after="fold_pad_conv")
    for a, b in zip(run(g, f), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(g, f)[0], ort_run(data, f)[0], rtol=1e-4, atol=1e-5)
    return g, before, g.op_counts(), n, logs


def test_pad_conv_same_padding_structure_counts_numerics():
    g, before, after, n, logs = _fold(same_pad_cnn(), (1, 3, 48, 64))
    assert n == 3 and before["Pad"] == 3 and "Pad" not in after
    assert after["Conv"] == before["Conv"] == 6
    convs = [x for x in g.nodes if x.op is N.Conv]
    # TF same: (ceil(i / s) - 1) * s + k - i, the odd one at the end
    want = {(3, 2): (0, 0, 1, 1), (3, 1): (1, 1, 1, 1), (5, 2): (1, 1, 2, 2)}
    padded = [c for c in convs if " + " in c.name]
    assert len(padded) == 3 and all(c.name.split(" + ")[0].endswith("Pad") for c in padded)
    for c in padded:
        key = (c.attrs.kernel_shape[0] if c.attrs.kernel_shape else c.inputs[1].type.shape[2],
               c.attrs.strides[0])
        assert tuple(c.attrs.pads) == want[key]
        assert c.inputs[0].producer is None or c.inputs[0].producer.op is not T.Pad
    assert sum(m.startswith("fused ") for m in logs) == 3


def test_pad_avgpool_counts_the_pad():
    g, before, after, n, _ = _fold(pad_then("avgpool"), (1, 4, 10, 12))
    assert n == 1 and before["Pad"] == 1 and after == {"AveragePool": 1}
    (pool,) = g.nodes
    assert pool.attrs.count_include_pad == 1 and tuple(pool.attrs.pads) == (0, 1, 1, 2)
    assert pool.inputs[0] is g.inputs[0]


def test_pad_conv_torch_pad():
    g, _, after, n, _ = _fold(pad_then("conv"), (1, 4, 10, 12))
    assert n == 1 and after == {"Conv": 1} and tuple(g.nodes[0].attrs.pads) == (0, 1, 1, 2)


@pytest.mark.parametrize("kind,why", [("reflect", "not a constant zero pad"),
                                      ("value", "not a constant zero pad"),
                                      ("maxpool", None)])
def test_no_fuse_pad_conv_not_zero_or_maxpool(kind, why):
    g, before, after, n, logs = _fold(pad_then(kind), (1, 4, 10, 12))
    assert n == 0 and after == before and after["Pad"] == 1
    near = [m for m in logs if m.startswith("not fused: pad + ")]
    assert (why is None and not near) or (len(near) == 1 and why in near[0])
