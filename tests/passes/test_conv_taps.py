"""drop_dead_conv_taps on real exports: an ASPP-style block (torchvision DeepLabV3's dilated 3x3
branches, rates past the map's size) and a wide strip whose one axis only keeps its taps,
tested for structure, counts and numerics against onnxruntime; must not fire where every tap
reads an input pixel, where the spatial dims are not fixed, or where the weight is no constant."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.engine.profile import Profile
from kiln.frontend import fixed_dims, import_onnx
from kiln.ir import Node, Value
from kiln.ops import nn as N
from kiln.ops import tensor as T
from kiln.passes.fusion.conv_taps import drop_dead_taps, live_taps
from kiln.passes.pipeline import optimize
from kiln.passes.verifier import verify
from tests.passes.exports import export_module, ort_run
from tests.passes.transformer_util import run

torch = pytest.importorskip("torch")

FOLDING = {"fold_to_fixed_point", "fold_constants", "fold_shape_inputs", "remove_noops",
           "merge_common_nodes", "remove_dead_nodes"}


class _Aspp(torch.nn.Module):
    """DeepLabV3's ASPP branches on an 8 x 8 map: rates 1 (1x1), 3, 8 and 12 (3x3)."""

    def __init__(self):
        super().__init__()
        self.b = torch.nn.ModuleList(
            [torch.nn.Conv2d(16, 8, 1)] + [torch.nn.Conv2d(16, 8, 3, padding=r, dilation=r)
                                           for r in (3, 8, 12)])

    def forward(self, x):
        return torch.cat([torch.relu(b(x)) for b in self.b], 1)


class _Strip(torch.nn.Module):
    """A 2 x 40 strip under a dilation-4 3x3 window (its rows' outer taps only read padding),
    a stride-2 one, and a grouped conv whose window is 5 x 5 at dilation 3 on a 3 x 20 map."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(6, 6, 3, padding=4, dilation=4)
        self.s = torch.nn.Conv2d(6, 6, 3, padding=4, dilation=4, stride=2)
        self.g = torch.nn.Conv2d(6, 6, 5, padding=6, dilation=3, groups=3)

    def forward(self, x):
        return self.a(x), self.s(x), self.g(x[:, :, :1])


def _graph(module, shape):
    m = export_module(module, shape)
    data = m.SerializeToString()
    g = import_onnx(data, fixed=fixed_dims([Profile.fixed({"x": shape})]))
    optimize(g, only=FOLDING)
    return g, data


def _drop(module, shape):
    g, data = _graph(module, shape)
    f = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    ref, logs = run(g, f), []
    n = drop_dead_taps(g, logs.append)
    verify(g, after="drop_dead_conv_taps")
    got, want = run(g, f), ort_run(data, f)
    for a, b, c in zip(got, ref, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)
    return g, n, logs


def _windows(g):
    return [(tuple(c.inputs[1].type.shape[2:]), tuple(c.attrs.dilations or (1, 1)),
             tuple(c.attrs.pads or (0,) * 4)) for c in g.nodes if c.op is N.Conv]


def test_aspp_branches_past_the_map_become_1x1():
    g, n, logs = _drop(_Aspp(), (1, 16, 8, 8))
    # rate 3 keeps its 3x3 window; rates 8 and 12 on an 8 x 8 map read only padding off centre
    assert n == 2 and len(logs) == 2 and all("conv dead taps: window 3x3 -> 1x1" in m
                                             for m in logs)
    assert sorted(_windows(g)) == sorted([((1, 1), (1, 1), (0, 0, 0, 0)),
                                          ((3, 3), (3, 3), (3, 3, 3, 3)),
                                          ((1, 1), (1, 1), (0, 0, 0, 0)),
                                          ((1, 1), (1, 1), (0, 0, 0, 0))])
    assert g.op_counts()["Conv"] == 4
    # the full windows' weights are gone, the sliced ones are the centre taps
    shapes = sorted(w.const.shape for w in g.weights.values() if w.const.ndim == 4)
    assert shapes == [(8, 16, 1, 1)] * 3 + [(8, 16, 3, 3)]


def test_strip_keeps_its_wide_axis_and_strides():
    g, n, logs = _drop(_Strip(), (1, 6, 2, 40))
    assert n == 3
    wins = _windows(g)
    # rows: 2 (1 for the grouped conv) under dilation 4 / 3 keep the centre tap only; columns
    # keep every tap and their dilation
    assert wins[0] == ((1, 3), (1, 4), (0, 4, 0, 4))
    assert wins[1] == ((1, 3), (1, 4), (0, 4, 0, 3))  # stride 2: one output row reads row 0
    assert wins[2] == ((1, 5), (1, 3), (0, 6, 0, 6))


def test_must_not_fire_where_every_tap_reads_the_input():
    g, n, logs = _drop(_Aspp(), (1, 16, 30, 30))  # rate 12 on 30 x 30: every tap reads pixels
    assert n == 0 and not logs
    assert sorted(_windows(g))[-1] == ((3, 3), (12, 12), (12, 12, 12, 12))


def test_must_not_fire_on_dynamic_spatial_dims_or_a_computed_weight():
    m = export_module(_Aspp(), (1, 16, 8, 8))
    for d in m.graph.input[0].type.tensor_type.shape.dim[2:]:  # H and W left to run time
        d.ClearField("dim_value")
        d.dim_param = "hw"
    g = import_onnx(m.SerializeToString())
    assert drop_dead_taps(g, lambda m: None) == 0
    # a weight computed at run time (here an Identity of the weight) is no constant
    g, _ = _graph(_Aspp(), (1, 16, 8, 8))
    conv = next(c for c in g.nodes if c.op is N.Conv and (c.attrs.dilations or (1,))[0] == 12)
    w = conv.inputs[1]
    made = Value(g.fresh_name("w_run_time"), w.type)
    g.nodes.insert(g.nodes.index(conv), Node(T.Identity, "copy_w", [w], [made]))
    conv.inputs[1] = made
    logs = []
    assert drop_dead_taps(g, logs.append) == 1 and logs[0].startswith("/b.2/")  # rate 8 only
    assert tuple(conv.inputs[1].type.shape[2:]) == (3, 3)


def test_live_taps():
    assert live_taps(16, 16, 3, 1, 24, 24) == (1, 1)
    assert live_taps(16, 16, 3, 1, 12, 12) == (0, 2)
    assert live_taps(2, 2, 3, 1, 4, 4) == (1, 1)
    assert live_taps(5, 3, 3, 2, 1, 1) == (0, 2)
    assert live_taps(4, 1, 3, 1, 1, 0) == (0, 2)
