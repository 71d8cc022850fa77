"""set_conv_layout: 2-D float32 convs run channels-last through oneDNN with packed weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.engine.engine import load
from kiln.frontend import import_onnx
from kiln.kernels.registry import Call
from kiln.kernels.torch import fused_conv as FCK
from kiln.ops import fused_conv as FC
from kiln.passes.fusion.conv_bias_act import fuse_conv_bias_act
from kiln.passes.fusion.layout import set_conv_layout
from tests.passes.transformer_util import RNG, apply, c, feeds, model, node, run

X = [2, 4, 9, 9]


def _block():
    """conv1 + relu -> conv2 (stride 2) + residual conv3 + relu -> maxpool -> y."""
    inits = {f"W{i}": c(RNG.standard_normal((8, 4 if i != 2 else 8, 3, 3)) * 0.2)
             for i in (1, 2, 3)}
    inits.update({f"B{i}": c(RNG.standard_normal(8)) for i in (1, 2, 3)})
    nodes = [node("Conv", ["x", "W1", "B1"], "a", name="conv1", pads=[1, 1, 1, 1]),
             node("Relu", ["a"], "ar", name="relu1"),
             node("Conv", ["ar", "W2", "B2"], "b", name="conv2", pads=[1, 1, 1, 1],
                  strides=[2, 2]),
             node("Conv", ["x", "W3", "B3"], "d", name="conv3", pads=[1, 1, 1, 1],
                  strides=[2, 2]),
             node("Add", ["b", "d"], "s", name="add"), node("Relu", ["s"], "sr", name="relu2"),
             node("MaxPool", ["sr"], "y", name="pool", kernel_shape=[2, 2])]
    return model(nodes, {"x": X}, ["y"], inits)


def _both(g, log):
    return fuse_conv_bias_act(g, log) + set_conv_layout(g, log)


def test_set_conv_layout_structure_and_counts():
    g, before, after, n, logs = apply(_block(), _both, feeds(x=X), atol=1e-4)
    assert before == {"Add": 1, "Conv": 3, "MaxPool": 1, "Relu": 2}
    assert after == {"FusedConv": 3, "MaxPool": 1}
    assert all(x.attrs.layout == "nhwc" for x in g.nodes if x.op is FC.FusedConv)
    assert "layout conv2: NHWC, packed weight" in logs  # the plain conv became a FusedConv
    # the residual joins the product computed last
    assert [x.name for x in g.nodes if x.op is FC.FusedConv][-1] == "conv3 + add + relu2"


def test_set_conv_layout_numerics_other_batch():
    m = _block()
    g, _, _, _, _ = apply(m, _both, feeds(x=X), atol=1e-4)  # packs weights for batch 2
    big = feeds(x=[5, 4, 9, 9])
    np.testing.assert_allclose(run(g, big)[0], run(import_onnx(m), big)[0], atol=1e-4)


def test_set_conv_layout_engine_roundtrip(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_block().SerializeToString())
    engine = kiln.Builder(kiln.BuilderConfig()).build(str(path))
    x = feeds(x=X)
    want = engine.create_context().run(x)
    engine.save(tmp_path / "m.kiln")
    got = load(tmp_path / "m.kiln").create_context().run(x)
    ref = kiln.Builder(kiln.BuilderConfig(optimize=False)).build(str(path)).create_context().run(x)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), atol=1e-4)


def test_no_fuse_layout_conv_weight_not_constant():
    m = model([node("Conv", ["x", "W"], "y", name="conv")], {"x": X, "W": [8, 4, 3, 3]}, ["y"])
    _, before, after, n, _ = apply(m, set_conv_layout, feeds(x=X, W=[8, 4, 3, 3]))
    assert n == 0 and before == after


def test_no_fuse_layout_conv_1d():
    m = model([node("Conv", ["x", "W"], "y", name="conv")], {"x": [2, 4, 9]}, ["y"],
              {"W": c(RNG.standard_normal((8, 4, 3)))})
    _, before, after, n, _ = apply(m, set_conv_layout, feeds(x=[2, 4, 9]))
    assert n == 0 and before == after


# ---- the CUDA channels-last path of the FusedConv kernel, run on CPU tensors by pretending
# they are on the device (the kernel decides through fused_conv._on_cuda)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(FCK, "_on_cuda", lambda t: True)
    monkeypatch.setattr(FCK, "CUDA_CHANNELS_LAST", True)
    return monkeypatch


def _conv_call(**attrs):
    return Call(FC.FusedConv.Attrs(**{**{f: d.default for f, d in FC.FusedConv.attrs.items()},
                                      **attrs}), n_out=1, n_in=4)


CONV_CASES = [  # x shape, w shape, attrs, bias, residual
    ((2, 8, 9, 9), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1], activation="Relu"), True, True),
    ((2, 8, 9, 9), (16, 8, 1, 1), dict(strides=[2, 2]), False, False),
    ((1, 8, 10, 10), (8, 4, 3, 3), dict(pads=[0, 0, 1, 1], group=2, activation="Clip",
                                        alpha=-1.0, beta=1.0), True, False),  # asymmetric pads
    ((3, 6, 7, 7), (6, 1, 3, 3), dict(pads=[1, 1, 1, 1], group=6, activation="Silu",
                                      has_residual=1), True, True),  # depthwise
]


def _conv_inputs(xs, ws, bias, res, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(xs, generator=g).to(dtype)
    w = (torch.randn(ws, generator=g) * 0.2).to(dtype)
    b = torch.randn(ws[0], generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("xs,ws,attrs,bias,res", CONV_CASES)
def test_cuda_channels_last_matches_nchw(fake_cuda, dtype, xs, ws, attrs, bias, res):
    fake_cuda.setattr(FCK, "_NHWC_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    x, w, b = _conv_inputs(xs, ws, bias, res, dtype)
    n_ref, n = _conv_call(**attrs), _conv_call(**attrs)
    with torch.inference_mode():
        y_ref0 = FCK.conv_reference(n_ref, x, w, b)
        r = torch.randn(y_ref0.shape).to(dtype) if res else None
        r_keep = None if r is None else r.clone()
        fake_cuda.setattr(FCK, "CUDA_CHANNELS_LAST", False)
        want = FCK.fused_conv(n_ref, x, w, b, r)
        fake_cuda.setattr(FCK, "CUDA_CHANNELS_LAST", True)
        got = FCK.fused_conv(n, x, w, b, r)
        assert want.is_contiguous() and got.is_contiguous(memory_format=torch.channels_last)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= tol * scale
        if r is not None:
            assert torch.equal(r, r_keep)  # the residual is read, never written
        # the weight is made channels-last once and kept; a channels-last input passes through
        wcl = [v for k, v in n.cache.items() if k[0] == "w_nhwc"]
        assert len(wcl) == 1 and wcl[0][0] is w
        assert wcl[0][1].is_contiguous(memory_format=torch.channels_last)
        got2 = FCK.fused_conv(n, x.contiguous(memory_format=torch.channels_last), w, b, r)
        assert [v for k, v in n.cache.items() if k[0] == "w_nhwc"][0][1] is wcl[0][1]
        assert torch.equal(got2, got)
        assert not n_ref.cache  # the NCHW path keeps nothing


def test_cuda_channels_last_chain_stays_nhwc(fake_cuda):
    """conv -> conv: the second conv gets a channels-last tensor and makes no copy of it."""
    fake_cuda.setattr(FCK, "_NHWC_DTYPES", (torch.float32,))
    x, w, b = _conv_inputs((2, 8, 9, 9), (8, 8, 3, 3), True, False, torch.float32)
    n1, n2 = _conv_call(pads=[1, 1, 1, 1], activation="Relu"), _conv_call(pads=[1, 1, 1, 1])
    seen = []
    real = FCK.conv_reference

    def spy(n, xx, ww, bb=None):
        seen.append(xx)
        return real(n, xx, ww, bb)

    fake_cuda.setattr(FCK, "conv_reference", spy)
    with torch.inference_mode():
        a = FCK.fused_conv(n1, x, w, b)
        y = FCK.fused_conv(n2, a, w, b)
        fake_cuda.setattr(FCK, "CUDA_CHANNELS_LAST", False)
        want = FCK.fused_conv(_conv_call(pads=[1, 1, 1, 1]),
                              FCK.fused_conv(_conv_call(pads=[1, 1, 1, 1], activation="Relu"),
                                             x, w, b), w, b)
    assert seen[1] is a  # no copy between consecutive convs
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.contiguous(), want, rtol=1e-5, atol=1e-5)


def test_cpu_and_fp32_keep_their_paths(monkeypatch):
    """Real CPU tensors never take the channels-last CUDA branch; nor does FP32 on "CUDA"."""
    x, w, b = _conv_inputs((1, 4, 6, 6), (4, 4, 3, 3), True, False, torch.bfloat16)
    assert not FCK._nhwc_cuda(x, w)
    monkeypatch.setattr(FCK, "_on_cuda", lambda t: True)
    assert FCK._nhwc_cuda(x, w) and not FCK._nhwc_cuda(x.float(), w.float())
    assert not FCK._nhwc_cuda(x[0], w)  # 3-D input
    monkeypatch.setattr(FCK, "CUDA_CHANNELS_LAST", False)
    assert not FCK._nhwc_cuda(x, w)
