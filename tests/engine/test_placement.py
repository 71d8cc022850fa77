"""Device placement on a CUDA executor (kiln.engine.placement), checked on CPU through the meta
device: a meta tensor meeting a host one fails as a CUDA one would, and reading a meta value
(``.item()``) fails as a CUDA-graph capture would. The models are the two patterns that crashed
real CNN exports at their first CUDA run: a resize whose size is computed from the input's shape
(YOLO necks) and TF-'SAME' padding computed from ``x.shape`` (EfficientNet stems)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.engine.engine import Engine
from kiln.engine.executor import Executor
from kiln.engine.placement import Placement
from kiln.engine.step import Step
from kiln.ops import math as M
from kiln.ops import tensor as T
from kiln.ops import vision as V

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
META = torch.device("meta")


class ShapeResize(nn.Module):
    """Upsample to a size computed from the shape, and by a constant scale (bilinear)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        y = F.silu(self.a(x))
        u = F.interpolate(y, size=(y.shape[2] * 2, y.shape[3] * 2), mode="nearest")
        v = F.interpolate(y, scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.b(torch.cat([u, v], 1))


class SamePad(nn.Module):
    """TF 'SAME' padding from x.shape, then conv + ReLU6 (a FusedConv with Clip)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, 2)

    def forward(self, x):
        ih, iw = x.shape[-2:]
        ph = max((math.ceil(ih / 2) - 1) * 2 + 3 - ih, 0)
        pw = max((math.ceil(iw / 2) - 1) * 2 + 3 - iw, 0)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])
        return F.hardtanh(self.c(x), 0.0, 6.0)


MODELS = {"shape_resize": ShapeResize, "same_pad": SamePad}


@pytest.fixture(scope="module", params=sorted(MODELS))
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    m = MODELS[request.param]().eval()
    path = tmp_path_factory.mktemp("placement") / f"{request.param}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(1, 3, 33, 47),), str(path), opset_version=17,
                          dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "b", 2: "h", 3: "w"}})
    return m, str(path)


def _meta_executor(engine) -> Executor:
    return Executor(engine.graph, "cpu", Engine._chooser(engine.choices), device=META)


@pytest.mark.parametrize("fp16", [False, True])
def test_placement_computed_shapes_stay_on_device(exported, fp16):
    m, path = exported
    e = kiln.Builder(kiln.BuilderConfig(fp16=fp16, low_precision_io=fp16)).build(path)
    ex = _meta_executor(e)
    x = torch.randn(2, 3, 33, 47, device=META, dtype=torch.float16 if fp16 else torch.float32)
    (y,) = ex.run([x])
    with torch.no_grad():
        want = m(torch.randn(2, 3, 33, 47)).shape
    assert y.device == META and tuple(y.shape) == tuple(want)
    assert ex.placement.moved == {}  # nothing came back on the host


def test_placement_cpu_numerics(exported):
    m, path = exported
    x = np.random.default_rng(0).standard_normal((2, 3, 33, 47)).astype(np.float32)
    (y,) = kiln.Builder().build(path).create_context().run({"x": x}).values()
    with torch.no_grad():
        want = m(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_placement_resize_scales_stay_on_host(exported):
    _, path = exported
    ex = _meta_executor(kiln.Builder().build(path))
    read = {st.ins[k] for st in ex.steps if st.node.op is V.Resize
            for k in (1, 2) if st.ins[k] >= 0}
    homes = {s: c.device.type for s, c in ex.consts if s in read}
    assert all(d == "cpu" for d in homes.values())  # float scales read with .tolist()


class _Node:
    def __init__(self, op, name):
        self.op, self.name, self.inputs, self.outputs = op, name, (), ()


def test_placement_names_a_host_fallback():
    def numpy_relu(call, x):  # a kernel that goes through the host
        return torch.zeros(x.shape, device="cpu")

    st = Step(numpy_relu, None, (0,), (1,), (), _Node(M.Relu, "relu0"))
    p = Placement(META)
    y = p.launch(st, [torch.empty(3, 5, device=META)])
    assert y.device == META
    assert "relu0" in p.moved and "host tensor from device inputs" in p.moved["relu0"]


def test_placement_large_host_value_goes_up_and_small_stays():
    def const_of_shape(call, shape):
        return torch.zeros([int(v) for v in shape.tolist()])

    big = Step(const_of_shape, None, (0,), (1,), (), _Node(T.ConstantOfShape, "cos"))
    p = Placement(META)
    assert p.launch(big, [torch.tensor([4, 100])]).device == META
    assert "cos" in p.lifted and p.moved == {}
    # run again: now under the device context, so made on the device (no host copy)
    assert p.launch(big, [torch.tensor([4, 100])]).device == META
    small = Step(const_of_shape, None, (0,), (1,), (), _Node(T.ConstantOfShape, "small"))
    assert p.launch(small, [torch.tensor([2])]).device.type == "cpu"
    shape = Step(lambda call, x: torch.tensor(list(x.shape)), None, (0,), (1,), (),
                 _Node(T.Shape, "shape"))
    assert p.launch(shape, [torch.empty(2, 3, device=META)]).device.type == "cpu"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp16", [False, True])
def test_placement_cuda_first_run(exported, fp16):
    m, path = exported
    cfg = kiln.BuilderConfig(device="cuda", fp16=fp16, tf32=False)
    ctx = kiln.Builder(cfg).build(path).create_context()
    x = np.random.default_rng(1).standard_normal((2, 3, 33, 47)).astype(np.float32)
    for _ in range(3):  # eager, capture, replay
        (y,) = ctx.run({"x": x}).values()
    with torch.no_grad():
        want = m(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2e-2 if fp16 else 1e-4,
                               atol=2e-2 if fp16 else 1e-4)


def test_placement_declared_host_fallback_is_named_not_failed():
    from kiln.ops import text_ml as X

    st = Step(lambda call, x: torch.zeros(4, 4, 3, device="cpu"), None, (0,), (1,), (),
              _Node(X.ImageDecoder, "decode"))
    p = Placement(META)
    assert p.launch(st, [torch.empty(100, dtype=torch.uint8, device=META)]).device == META
    assert p.moved == {} and "PIL" in p.host["decode"]
