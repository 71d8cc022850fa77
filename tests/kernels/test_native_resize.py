"""kiln.native's bilinear resize (kiln/native/resize.c) against F.interpolate and the ONNX
reference: up and down, odd factors, align_corners, NCHW and channels-last (the output keeps
the layout), several planes, the thread split; the Resize kernel takes it for float32 linear
resizes, and leaves other layouts and dtypes to F.interpolate (must not fire)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln import native

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")

SHAPES = [  # N, C, H, W, Ho, Wo
    (1, 21, 40, 40, 320, 320),  # LR-ASPP's head upsample (x8)
    (1, 21, 16, 16, 256, 256),  # DeepLabV3's (x16)
    (2, 5, 7, 9, 30, 17),       # odd factors, two images
    (1, 3, 12, 10, 5, 4),       # down
    (1, 256, 1, 1, 16, 16),     # a pooled branch broadcast back
    (3, 2, 3, 1, 7, 5),         # a width of 1
    (1, 1, 4, 4, 9, 9),         # one channel: NCHW and channels-last are the same strides
]


@needs_native
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("corners", [False, True])
def test_resize_matches_interpolate(shape, layout, corners):
    n, c, h, w, ho, wo = shape
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(0))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    want = F.interpolate(x, (ho, wo), mode="bilinear", align_corners=corners)
    got = native.resize_linear2d(x, (ho, wo), corners)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6)
    ref64 = F.interpolate(x.double(), (ho, wo), mode="bilinear", align_corners=corners)
    torch.testing.assert_close(got.double(), ref64, rtol=1e-5, atol=1e-5)
    assert got.stride() == want.stride()  # F.interpolate's layout, 1 x 1 maps included


@needs_native
def test_resize_thread_split_changes_nothing():
    x = torch.randn(1, 21, 40, 40).contiguous(memory_format=torch.channels_last)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.resize_linear2d(x, (320, 320), False)
        torch.set_num_threads(2)
        two = native.resize_linear2d(x, (320, 320), False)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@needs_native
def test_resize_kernel_takes_the_native_path_and_leaves_the_others(monkeypatch):
    """A float32 NCHW or channels-last linear Resize runs resize.c (F.interpolate is not
    called); a strided view and a float64 tensor go to F.interpolate (must not fire)."""
    from kiln.kernels.torch import vision as KV

    calls = []
    real = F.interpolate
    monkeypatch.setattr(torch.nn.functional, "interpolate",
                        lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    opts = {"mode": "linear", "coord": "half_pixel", "nearest_mode": "floor",
            "antialias": False, "exclude_outside": False}
    x = torch.randn(1, 4, 6, 5)
    for t in (x, x.contiguous(memory_format=torch.channels_last)):
        got = KV._interpolate(t, list(t.shape), [1, 4, 24, 20], [1, 1, 4.0, 4.0], {}, opts)
        torch.testing.assert_close(got, real(x, (24, 20), mode="bilinear"), rtol=1e-6,
                                   atol=2e-6)
    assert calls == []
    for t in (x[:, :, :, ::2], x.double()):
        KV._interpolate(t, list(t.shape), [1, 4, 24, 4 * t.shape[3]], [1, 1, 4.0, 4.0], {}, opts)
    assert calls == [torch.float32, torch.float64]


@needs_native
def test_resize_against_the_onnx_reference():
    """The model-level check: a half_pixel linear Resize by sizes, as torchvision exports its
    segmentation heads' upsample, against onnx.reference."""
    from tests.ops.test_vision import _check_loose, _resize_model

    x = np.random.default_rng(2).standard_normal((1, 21, 10, 10)).astype(np.float32)
    m = _resize_model(x, sizes=np.array([1, 21, 80, 80], np.int64), mode="linear",
                      coordinate_transformation_mode="half_pixel")
    _check_loose(m, {"X": x})


@needs_native
def test_resize_of_a_pooled_nhwc_map_stays_channels_last():
    """A [1, 256, 1, 1] map with NHWC strides (256, 1, 256, 256), as a channels-last conv or
    pool makes it, comes back channels-last (F.interpolate's choice), so the convs after it
    read NHWC without a copy."""
    x = torch.randn(1, 1, 1, 256).permute(0, 3, 1, 2)
    want = F.interpolate(x, (16, 16), mode="bilinear", align_corners=False)
    got = native.resize_linear2d(x, (16, 16), False)
    assert got.stride() == want.stride() == (65536, 1, 4096, 256)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6)
