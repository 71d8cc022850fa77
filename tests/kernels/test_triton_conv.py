import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.registry import kernels_for
from kiln.kernels.torch import fused_conv as torch_fused
from kiln.kernels.triton import common, conv
from kiln.ops import fused_conv as FC
from tests.kernels.triton_util import INTERPRET, assert_close, call, gpu, randn

CL = torch.channels_last
# the torch activations the epilogue must reproduce, with the op's (alpha, beta)
ACT = {"": lambda y: y, "Relu": torch.relu, "Gelu": F.gelu, "Silu": F.silu,
       "GeluTanh": lambda y: F.gelu(y, approximate="tanh"), "Sigmoid": torch.sigmoid,
       "Tanh": torch.tanh, "HardSwish": F.hardswish,
       "Clip": lambda y: y.clamp(-0.5, 0.5), "LeakyRelu": lambda y: F.leaky_relu(y, 0.2)}
PARAMS = {"Clip": (-0.5, 0.5), "LeakyRelu": (0.2, 0.0)}
# the dtype of the whole-kernel tests: on a GPU it takes FP16/BF16 only
DTYPE = torch.float32 if INTERPRET else torch.float16


def nhwc(*shape, dtype=torch.float32, device=None):
    kw = {} if device is None else {"device": device}
    return randn(*shape, dtype=dtype, **kw).contiguous(memory_format=CL)


def _epilogue_ref(y, bias, res, activation):
    out = y.float()
    if bias is not None:
        out = out + bias.float().reshape(1, -1, 1, 1)
    if res is not None:
        out = out + res.float()
    return ACT[activation](out)


def _fused(activation="", residual=False, **attrs):
    alpha, beta = PARAMS.get(activation, (0.0, 0.0))
    return call(FC.FusedConv, activation=activation, alpha=alpha, beta=beta,
                has_residual=int(residual), **attrs)


# ---------------------------------------------------------------- the epilogue kernel


@pytest.mark.parametrize("activation", sorted(ACT))
def test_triton_conv_epilogue_activations(activation):
    y, b, r = nhwc(2, 5, 3, 3), randn(5), nhwc(2, 5, 3, 3)
    alpha, beta = PARAMS.get(activation, (0.0, 0.0))
    want = _epilogue_ref(y, b, r, activation)
    out = conv.bias_act_(y, b, r, activation, alpha, beta, block=8, num_warps=1)
    assert out is y
    assert_close(y, want)


@pytest.mark.parametrize("bias,res", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape,block", [((1, 37, 3, 5), 16),  # C tiles, the last one partial
                                         ((1, 37, 3, 5), 64),  # one C tile wider than C
                                         ((3, 4, 5, 7), 32)],  # 8 rows a tile, last partial
                         ids=["c-tail", "c-wide", "row-tail"])
def test_triton_conv_epilogue_masks(shape, block, bias, res):
    y = nhwc(*shape)
    b = randn(shape[1]) if bias else None
    r = nhwc(*shape) if res else None
    want = _epilogue_ref(y, b, r, "Relu")
    conv.bias_act_(y, b, r, "Relu", block=block, num_warps=1)
    assert_close(y, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_conv_epilogue_half(dtype):
    y, b, r = nhwc(2, 12, 4, 3, dtype=dtype), randn(12, dtype=dtype), nhwc(2, 12, 4, 3,
                                                                           dtype=dtype)
    want = _epilogue_ref(y, b, r, "Silu")
    conv.bias_act_(y, b, r, "Silu", block=32, num_warps=1)
    assert y.dtype == dtype
    assert_close(y, want)


def test_triton_conv_epilogue_wide_offsets():
    # the int64 offsets of outputs of 2**31 elements or more, on a tiny tensor
    y, b = nhwc(2, 6, 3, 3), randn(6)
    want = _epilogue_ref(y, b, None, "Relu")
    common.launch(common.bias_act_kernel, (3, 1), y, b, y, 18, 6, 0.0, 0.0, HAS_BIAS=True,
                  HAS_RES=False, ACT=common.ACT_CODE["Relu"], WIDE=True, BLOCK_P=8, BLOCK_C=8,
                  num_warps=1)
    assert_close(y, want)


def test_triton_conv_epilogue_nothing_to_fuse_launches_nothing(monkeypatch):
    monkeypatch.setattr(common, "launch", lambda *a, **k: pytest.fail("launched a kernel"))
    y = nhwc(1, 3, 2, 2)
    before = y.clone()
    assert conv.bias_act_(y) is y
    assert torch.equal(y, before)


def test_triton_conv_epilogue_rejects_nchw():
    y = randn(1, 3, 2, 2)  # NCHW-contiguous: the channel is not the fastest dim
    with pytest.raises(ValueError, match="channels-last"):
        conv.bias_act_(y, randn(3), None, "Relu")


# ---------------------------------------------------------------- the whole kernel

# (x shape, w shape, attributes): ResNet's 1x1 and strided 3x3 and 7x7 stem, groups with
# dilation, and auto_pad that works out symmetric
CONVS = [((2, 8, 5, 5), (12, 8, 1, 1), {}),
         ((1, 6, 9, 7), (10, 6, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
         ((1, 3, 12, 12), (8, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),
         ((1, 6, 8, 8), (4, 3, 3, 3), {"group": 2, "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
         ((2, 4, 6, 5), (6, 4, 3, 3), {"auto_pad": "SAME_UPPER"}),
         ((1, 4, 6, 6), (5, 4, 3, 3), {"auto_pad": "VALID", "strides": [1, 2]})]
CONV_IDS = ["1x1", "3x3-s2", "7x7-stem", "grouped-dilated", "same-upper", "valid"]


def _out_shape(x, w, n):
    return torch_fused.conv_reference(call(FC.FusedConv, **_attrs(n)), x, w).shape


def _attrs(n):
    return {k: getattr(n.a, k) for k in ("auto_pad", "dilations", "group", "kernel_shape",
                                         "pads", "strides")}


def _inputs(xs, ws, n, bias=True, residual=True, dtype=DTYPE, device=None):
    kw = {"dtype": dtype} if device is None else {"dtype": dtype, "device": device}
    x, w = randn(*xs, **kw), randn(*ws, **kw) / (ws[1] * ws[2] * ws[3]) ** 0.5
    b = randn(ws[0], **kw) if bias else None
    r = nhwc(*_out_shape(x, w, n), **kw) if residual else None
    return x, w, b, r


@pytest.mark.parametrize("xs,ws,attrs", CONVS, ids=CONV_IDS)
def test_triton_conv_matches_torch_kernel(xs, ws, attrs):
    n = _fused("Relu", residual=True, **attrs)
    x, w, b, r = _inputs(xs, ws, n)
    assert conv.supports(n, (x, w, b, r))
    y = conv.fused_conv(n, x, w, b, r)
    want = torch_fused.fused_conv(_fused("Relu", residual=True, **attrs), x, w, b, r)
    assert y.shape == want.shape and y.is_contiguous(memory_format=CL)
    assert_close(y, want, scale=2)


@pytest.mark.parametrize("activation", ["", "Clip", "LeakyRelu"])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True)])
def test_triton_conv_epilogue_variants(activation, bias, residual):
    xs, ws, attrs = CONVS[1]
    n = _fused(activation, residual, tactic=None, **attrs)
    x, w, b, r = _inputs(xs, ws, n, bias, residual)
    for t in conv.tactics(n, (x, w, b, r)):
        n.tactic = t
        want = torch_fused.fused_conv(_fused(activation, residual, **attrs), x, w, b, r)
        assert_close(conv.fused_conv(n, x, w, b, r), want, scale=2)


def test_triton_conv_nchw_residual_and_weight_cache():
    xs, ws, attrs = CONVS[0]
    n = _fused("Relu", residual=True, **attrs)
    x, w, b, r = _inputs(xs, ws, n)
    r = r.contiguous()  # NCHW: made channels-last for the kernel
    want = torch_fused.fused_conv(_fused("Relu", residual=True), x, w, b, r)
    assert_close(conv.fused_conv(n, x, w, b, r), want, scale=2)
    conv.fused_conv(n, x, w, b, r)
    kept = [v for k, v in n.cache.items() if k[0] == "w_nhwc"]
    assert len(kept) == 1 and kept[0][0] is w
    assert kept[0][1].is_contiguous(memory_format=CL)
    # a weight already channels-last (as the executor stores it) is used as it is
    n2, wcl = _fused("Relu", residual=True), w.contiguous(memory_format=CL)
    conv.fused_conv(n2, x, wcl, b, r)
    assert [v[1] for k, v in n2.cache.items() if k[0] == "w_nhwc"] == [wcl]


def test_triton_conv_tactics_off_gpu():
    xs, ws, attrs = CONVS[0]
    n = _fused("Relu", residual=True, **attrs)
    x, w, b, r = _inputs(xs, ws, n)
    space = conv.tactics(n, (x, w, b, r))
    assert len(space) > 1
    assert all(t.get("epilogue", "triton") == "triton" for t in space) == (not x.is_cuda)
    # nothing to fuse: the conv alone, and (a 1x1 conv) the GEMM tactics
    n0 = _fused("", **attrs)
    space0 = conv.tactics(n0, (x, w, None, None))
    assert space0[0] == conv.DEFAULT and all("impl" in t for t in space0[1:])
    assert not any(t["impl"] == "igemm" for t in space0[1:])  # a plain 1x1 is a GEMM already
    xs3, ws3, attrs3 = CONVS[1]  # a 3x3 conv: the implicit GEMM, no plain GEMM
    n3 = _fused("", **attrs3)
    x3, w3, _, _ = _inputs(xs3, ws3, n3, False, False)
    space3 = conv.tactics(n3, (x3, w3, None, None))
    assert space3[0] == conv.DEFAULT and {t["impl"] for t in space3[1:]} == {"igemm"}
    xsg, wsg, attrsg = CONVS[3]  # grouped: no implicit GEMM
    ng = _fused("", **attrsg)
    xg, wg, _, _ = _inputs(xsg, wsg, ng, False, False)
    assert conv.tactics(ng, (xg, wg, None, None)) == [conv.DEFAULT]


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("activation,bias,residual", [("Relu", True, True), ("", True, False),
                                                      ("Clip", False, True), ("Relu", True, False)])
def test_triton_conv_1x1_as_gemm(stride, activation, bias, residual):
    """1x1 convs as GEMMs: the Triton tile, cuBLAS + the epilogue pass, and (bias + ReLU, no
    residual: the only epilogue cuBLASLt computes whole here) cuBLASLt's fused epilogue."""
    attrs = {"strides": [stride, stride]}
    n = _fused(activation, residual, tactic=None, **attrs)
    x, w, b, r = _inputs((2, 8, 5, 5), (12, 8, 1, 1), n, bias, residual)
    want = torch_fused.fused_conv(_fused(activation, residual, **attrs), x, w, b, r)
    impls = [t["impl"] for t in conv.tactics(n, (x, w, b, r)) if "impl" in t]
    lt = {"cublaslt"} if (activation, bias, residual) == ("Relu", True, False) else set()
    assert set(impls) == ({"gemm", "cublas", "igemm"} if stride > 1 else {"gemm", "cublas"}) | lt
    gemms = [t for t in conv.tactics(n, (x, w, b, r))
             if t.get("impl") in ("gemm", "cublas", "cublaslt")]
    assert conv.makes_plan({"impl": "cublaslt"}) == "cublas"
    for t in [gemms[0], *[g for g in gemms if g["impl"] != "gemm"]]:  # one Triton tile: slow
        n.tactic, n.cache = t, {}
        y = conv.fused_conv(n, x, w, b, r)
        assert y.shape == want.shape and y.is_contiguous(memory_format=CL), t
        assert_close(y, want, scale=2)


# (CONVS index, tactic overrides): the tap-by-tap walk (C >= FLAT_BELOW) and the flat one (the
# stem), each plain and split over K; strides, pads, SAME_UPPER and VALID
IGEMM = [(1, {}), (2, {}), (2, {"SPLIT_K": 2, "BLOCK_K": 16}), (4, {}), (5, {}),
         ("wide", {}), ("wide", {"SPLIT_K": 3, "BLOCK_K": 16}), ("dilated", {})]
WIDE = ((2, 40, 6, 5), (24, 40, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 1]})
DILATED = ((1, 20, 9, 7), (10, 20, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]})


@pytest.mark.parametrize("which,over", IGEMM,
                         ids=["3x3-s2-flat", "stem", "stem-splitk", "same-upper", "valid",
                              "taps", "taps-splitk", "taps-dilated"])
@pytest.mark.parametrize("activation,bias,residual", [("Relu", True, True), ("", False, False),
                                                      ("HardSwish", True, False)])
def test_triton_conv_implicit_gemm(which, over, activation, bias, residual):
    xs, ws, attrs = {"wide": WIDE, "dilated": DILATED}.get(which) or CONVS[which]
    n = _fused(activation, residual, tactic=None, **attrs)
    x, w, b, r = _inputs(xs, ws, n, bias, residual)
    want = torch_fused.fused_conv(_fused(activation, residual, **attrs), x, w, b, r)
    space = [t for t in conv.tactics(n, (x, w, b, r)) if t.get("impl") == "igemm"]
    assert space, "no implicit-GEMM tactic"
    n.tactic, n.cache = dict(space[0], **over), {}
    y = conv.fused_conv(n, x, w, b, r)
    assert y.shape == want.shape and y.is_contiguous(memory_format=CL)
    assert_close(y, want, scale=2)


# (x, w, attrs): 3x3 MobileNet-style, a channel multiplier of 2 with stride and dilation, a
# 7x7 ConvNeXt-style with more channels than one tile, and SAME_UPPER
DEPTHWISE = [((2, 6, 7, 5), (6, 1, 3, 3), {"pads": [1] * 4, "group": 6}),
             ((1, 4, 9, 8), (8, 1, 3, 3), {"pads": [2] * 4, "strides": [2, 2],
                                           "dilations": [2, 2], "group": 4}),
             ((1, 40, 9, 9), (40, 1, 7, 7), {"pads": [3] * 4, "group": 40}),
             ((2, 5, 6, 6), (5, 1, 5, 5), {"auto_pad": "SAME_UPPER", "group": 5})]


@pytest.mark.parametrize("xs,ws,attrs", DEPTHWISE, ids=["3x3", "mult2-s2-dil2", "7x7", "same"])
@pytest.mark.parametrize("activation,bias,residual", [("Relu", True, True), ("", False, False),
                                                      ("Silu", True, False)])
def test_triton_conv_depthwise(xs, ws, attrs, activation, bias, residual):
    n = _fused(activation, residual, tactic=None, **attrs)
    x, w, b, r = _inputs(xs, ws, n, bias, residual)
    want = torch_fused.fused_conv(_fused(activation, residual, **attrs), x, w, b, r)
    space = [t for t in conv.tactics(n, (x, w, b, r)) if t.get("impl") == "depthwise"]
    assert space and not any(t.get("impl") == "igemm" for t in conv.tactics(n, (x, w, b, r)))
    for t in [space[0], space[-1]]:
        n.tactic, n.cache = t, {}
        y = conv.fused_conv(n, x, w, b, r)
        assert y.shape == want.shape and y.is_contiguous(memory_format=CL), t
        assert_close(y, want, scale=2)


def test_triton_conv_grouped_but_not_depthwise_has_no_depthwise_tactic():
    xs, ws, attrs = CONVS[3]  # 2 groups of 3 channels
    n = _fused("", **attrs)
    x, w, _, _ = _inputs(xs, ws, n, False, False)
    assert not any(t.get("impl") == "depthwise" for t in conv.tactics(n, (x, w, None, None)))


def test_triton_conv_implicit_gemm_splits_only_small_outputs():
    from kiln.kernels.triton import implicit_gemm as ig
    # ResNet-50 at batch 1: the 7x7 stage has 8 tiles of 64x64, the 56x56 stage 49+
    small = ig.tactics(1, 512, 512, 3, 3, 7, 7)
    assert any(t["SPLIT_K"] > 1 for t in small)
    big = ig.tactics(32, 64, 64, 3, 3, 56, 56)
    assert big and all(t["SPLIT_K"] == 1 for t in big)
    # every split has two K steps: 3 input channels (flat K = 147: 3 steps of 64) don't split
    stem = ig.tactics(1, 3, 64, 7, 7, 4, 4)
    assert stem and all(t["SPLIT_K"] == 1 for t in stem if t["BLOCK_K"] >= 64)
    assert all(-(-147 // t["BLOCK_K"]) >= 2 * t["SPLIT_K"] for t in stem)


def test_triton_conv_1x1_with_pads_is_not_a_gemm():
    n = _fused("Relu", pads=[1, 1, 1, 1])
    x, w, b, _ = _inputs((1, 4, 3, 3), (6, 4, 1, 1), n, True, False)
    impls = {t.get("impl") for t in conv.tactics(n, (x, w, b, None))}
    assert "gemm" not in impls and "cublas" not in impls and "igemm" in impls


def test_triton_conv_cudnn_tactic_off_gpu_runs_triton_epilogue():
    xs, ws, attrs = CONVS[1]
    n = _fused("Relu", residual=True, tactic=None, **attrs)
    x, w, b, r = _inputs(xs, ws, n)
    n.tactic = {"epilogue": "cudnn"}
    want = torch_fused.fused_conv(_fused("Relu", residual=True, **attrs), x, w, b, r)
    assert_close(conv.fused_conv(n, x, w, b, r), want, scale=2)


def _falls_back(monkeypatch, n, x, w, b=None, r=None):
    """fused_conv runs the torch kernel (no Triton launch) and gives its result."""
    assert not conv.supports(n, (x, w, b, r))
    monkeypatch.setattr(common, "launch", lambda *a, **k: pytest.fail("launched a kernel"))
    want = torch_fused.fused_conv(call(FC.FusedConv, **_attrs(n), activation=n.a.activation,
                                       has_residual=n.a.has_residual), x, w, b, r)
    y = conv.fused_conv(n, x, w, b, r)
    assert y.shape == want.shape
    assert_close(y, want, scale=2)


# asymmetric pads (x, w, attrs): TF-style "same" on a stride-2 3x3 (0 before, 1 after), an
# explicit uneven pad, SAME_UPPER with an even kernel, and the same on depthwise convs
ASYMMETRIC = [((1, 4, 8, 8), (5, 4, 3, 3), {"pads": [0, 0, 1, 1], "strides": [2, 2]}),
              ((1, 4, 6, 6), (5, 4, 3, 3), {"pads": [0, 1, 1, 2]}),
              ((1, 4, 6, 6), (5, 4, 2, 2), {"auto_pad": "SAME_UPPER"}),
              ((2, 6, 9, 8), (6, 1, 5, 5), {"pads": [1, 1, 2, 2], "strides": [2, 2],
                                            "group": 6}),
              ((1, 8, 8, 8), (8, 1, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2],
                                            "group": 8})]


@pytest.mark.parametrize("xs,ws,attrs", ASYMMETRIC,
                         ids=["tf-same-s2", "uneven", "same-upper-k2", "dw5-s2", "dw-same-s2"])
@pytest.mark.parametrize("residual", [False, True])
def test_triton_conv_asymmetric_pads_on_direct_kernels(xs, ws, attrs, residual, monkeypatch):
    """Asymmetric pads run on the implicit GEMM or the depthwise kernel only (nothing that
    calls cuDNN: no F.conv2d), each tactic matching the torch kernel; untuned (the default
    tactic), the torch kernel runs instead and no Triton kernel is launched."""
    n = _fused("Relu", residual, tactic=None, **attrs)
    x, w, b, r = _inputs(xs, ws, n, True, residual)
    want = torch_fused.fused_conv(_fused("Relu", residual, **attrs), x, w, b, r)
    assert conv.supports(n, (x, w, b, r))
    space = conv.tactics(n, (x, w, b, r))
    dw = (attrs.get("group") or 1) > 1
    assert space and {t.get("impl") for t in space} == {"depthwise" if dw else "igemm"}
    assert not any(conv.makes_plan(t) for t in space)
    monkeypatch.setattr(conv.F, "conv2d", lambda *a, **k: pytest.fail("ran cuDNN's conv"))
    for t in [space[0], space[-1]]:
        n.tactic, n.cache = t, {}
        y = conv.fused_conv(n, x, w, b, r)
        assert y.shape == want.shape and y.is_contiguous(memory_format=CL), t
        assert_close(y, want, scale=2)
    monkeypatch.undo()
    n.tactic, n.cache = None, {}
    monkeypatch.setattr(common, "launch", lambda *a, **k: pytest.fail("launched a kernel"))
    assert_close(conv.fused_conv(n, x, w, b, r), want, scale=2)


def test_no_triton_conv_grouped_asymmetric_pads(monkeypatch):
    """Grouped but not depthwise, with asymmetric pads: no direct kernel takes it."""
    n = _fused("Relu", pads=[0, 0, 1, 1], strides=[2, 2], group=2)
    _falls_back(monkeypatch, n, randn(1, 4, 8, 8, dtype=DTYPE), randn(6, 2, 3, 3, dtype=DTYPE))


def test_no_triton_conv_1d(monkeypatch):
    n = _fused("Relu")
    _falls_back(monkeypatch, n, randn(2, 4, 9, dtype=DTYPE), randn(5, 4, 3, dtype=DTYPE))


def test_no_triton_conv_broadcast_residual(monkeypatch):
    n = _fused("Relu", residual=True)
    x, w = randn(1, 4, 5, 5, dtype=DTYPE), randn(6, 4, 1, 1, dtype=DTYPE)
    _falls_back(monkeypatch, n, x, w, None, randn(1, 6, 1, 1, dtype=DTYPE))


def test_no_triton_conv_integer_input():
    n = _fused("")
    x, w = torch.ones(1, 2, 3, 3, dtype=torch.int64), torch.ones(3, 2, 1, 1, dtype=torch.int64)
    assert not conv.supports(n, (x, w, None, None))


def test_no_triton_conv_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(common, "INTERPRET", False)
    n = _fused("Relu", residual=True)
    x, w = randn(1, 4, 5, 5, device="cpu"), randn(6, 4, 1, 1, device="cpu")
    _falls_back(monkeypatch, n, x, w, randn(6, device="cpu"), nhwc(1, 6, 5, 5, device="cpu"))


def test_triton_conv_registered_for_cuda():
    assert "TritonFusedConv" in [k.name for k in kernels_for(FC.FusedConv, "cuda")]


def test_torch_epilogue_adds_in_place_where_residual_fits():
    n = _fused("Relu", residual=True)
    for rs in [(2, 3, 4), (3, 1), (4,)]:  # same shape, broadcast without growing y
        y, r = randn(2, 3, 4, device="cpu"), randn(*rs, device="cpu")
        want = torch.relu(y + r)
        out = torch_fused.epilogue(y, n.a, r)
        assert out is y and torch.equal(out, want)
    y, r = randn(3, 1, device="cpu"), randn(2, 3, 4, device="cpu")  # grows y: out of place
    out = torch_fused.epilogue(y, n.a, r)
    assert out is not y and out.shape == (2, 3, 4)
    with pytest.raises(RuntimeError):
        torch_fused.epilogue(randn(2, 3, device="cpu"), n.a, randn(4, device="cpu"))


# ---------------------------------------------------------------- GPU: every tactic, FP16

# ResNet-50's kinds of layer at batch 4: (x, w, attrs, activation, residual)
GPU_CONVS = [((4, 3, 64, 64), (64, 3, 7, 7), {"pads": [3] * 4, "strides": [2, 2]}, "Relu", False),
             ((4, 256, 28, 28), (64, 256, 1, 1), {}, "Relu", False),
             ((4, 128, 28, 28), (128, 128, 3, 3), {"pads": [1] * 4, "strides": [2, 2]}, "Relu",
              False),
             ((4, 128, 14, 14), (512, 128, 1, 1), {}, "Relu", True),
             ((4, 256, 14, 14), (512, 256, 1, 1), {"strides": [2, 2]}, "", False),
             ((4, 64, 14, 14), (64, 16, 3, 3), {"pads": [1] * 4, "group": 4}, "Clip", True),
             ((4, 96, 28, 28), (96, 1, 3, 3), {"pads": [1] * 4, "group": 96}, "Relu", True),
             ((2, 64, 14, 14), (128, 1, 7, 7), {"pads": [3] * 4, "strides": [2, 2], "group": 64},
              "", False)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("xs,ws,attrs,activation,residual", GPU_CONVS,
                         ids=["stem", "1x1", "3x3-s2", "1x1-res", "downsample", "grouped-clip",
                              "depthwise-3x3", "depthwise-7x7-mult2"])
def test_triton_conv_gpu_every_tactic(xs, ws, attrs, activation, residual, dtype):
    n = _fused(activation, residual, **attrs)
    x, w, b, r = _inputs(xs, ws, n, True, residual, dtype, device="cuda")
    x = x.contiguous(memory_format=CL)
    want = torch_fused.fused_conv(_fused(activation, residual, **attrs), x, w, b, r)
    space = conv.tactics(n, (x, w, b, r))
    assert ({"epilogue": "cudnn"} in space) == (activation == "Relu")
    for t in space:
        n.tactic, n.cache = t, {}
        y = conv.fused_conv(n, x, w, b, r)
        assert y.shape == want.shape and y.dtype == dtype, t
        assert_close(y, want, scale=4)


# ---------------------------------------------------------------- stem: channels padded to 4


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_triton_pad_channels_nhwc(c, layout):
    """One pass: any-strided [N, C, H, W] -> channels-last [N, 4, H, W], zeros from C on."""
    x = randn(2, c, 5, 7)
    if layout == "nhwc":
        x = x.contiguous(memory_format=CL)
    y = conv.pad_channels_nhwc(x)
    assert y.shape == (2, 4, 5, 7) and y.is_contiguous(memory_format=CL)
    assert torch.equal(y[:, :c], x) and not y[:, c:].any()


@pytest.mark.parametrize("activation,bias", [("Relu", True), ("", False)])
def test_triton_conv_stem_pads_channels(activation, bias, monkeypatch):
    """A 3-channel stem: the pad_c tactics run cuDNN's conv on the 4-channel padded image and
    weight (made once per node), with the result of the unpadded conv."""
    xs, ws, attrs = CONVS[2]  # (1, 3, 12, 12) * (8, 3, 7, 7), pads 3, stride 2
    n = _fused(activation, False, tactic=None, **attrs)
    x, w, b, _ = _inputs(xs, ws, n, bias, False)
    want = torch_fused.fused_conv(_fused(activation, False, **attrs), x, w, b, None)
    padded = [t for t in conv.tactics(n, (x, w, b, None)) if t.get("pad_c")]
    assert padded and all(t["pad_c"] == conv.PAD_C and "impl" not in t for t in padded)
    seen = []
    real = conv.F.conv2d
    monkeypatch.setattr(conv.F, "conv2d", lambda xx, ww, *a: seen.append(
        (xx.shape[1], ww.shape[1])) or real(xx, ww, *a))
    for t in padded:
        n.tactic, n.cache = t, {}
        y = conv.fused_conv(n, x, w, b, None)
        conv.fused_conv(n, x, w, b, None)
        assert y.shape == want.shape and y.is_contiguous(memory_format=CL)
        assert_close(y, want, scale=2)
        kept = [v for k, v in n.cache.items() if k[0] == "w_pad"]
        assert len(kept) == 1 and kept[0][0] is w and kept[0][1].shape[1] == conv.PAD_C
    assert seen and all(s == (conv.PAD_C, conv.PAD_C) for s in seen)


def test_triton_conv_no_channel_padding_off_the_stem():
    """Only one-group convs of fewer than 4 input channels get the pad_c tactics."""
    for i in (0, 1, 3, 4):  # 8, 6, 6 (grouped), 4 input channels
        xs, ws, attrs = CONVS[i]
        n = _fused("Relu", False, **attrs)
        x, w, b, _ = _inputs(xs, ws, n, True, False)
        assert not [t for t in conv.tactics(n, (x, w, b, None)) if t.get("pad_c")], i
