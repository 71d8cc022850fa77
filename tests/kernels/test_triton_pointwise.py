import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.ir import DType, TensorType
from kiln.kernels.triton import pointwise as P
from kiln.ops import fused_transformer as FT
from tests.kernels.triton_util import DEVICE, assert_close, call, gpu, randn

BIAS_GELU = {"inputs": 2, "outputs": ["t1"], "ops": [
    {"op": "Add", "in": ["i0", "i1"]},
    {"op": "Gelu", "in": ["t0"], "attrs": {"approximate": "none"}}]}

# 0.5 * x * (1 + tanh(0.79788456 * (x + 0.044715 * x^3))), as exporters spell GELU out
GELU_TANH_SPELLED = {"inputs": 1, "outputs": ["t7"], "ops": [
    {"op": "Pow", "in": ["i0", 3.0]},
    {"op": "Mul", "in": ["t0", 0.044715]},
    {"op": "Add", "in": ["i0", "t1"]},
    {"op": "Mul", "in": ["t2", 0.7978845608028654]},
    {"op": "Tanh", "in": ["t3"]},
    {"op": "Add", "in": ["t4", 1.0]},
    {"op": "Mul", "in": ["i0", 0.5]},
    {"op": "Mul", "in": ["t6", "t5"]}]}

# relu(x * scale[c] + shift[c] + residual): a BN-folded residual tail on NCHW
SCALE_SHIFT_RES_RELU = {"inputs": 4, "outputs": ["t3"], "ops": [
    {"op": "Mul", "in": ["i0", "i1"]},
    {"op": "Add", "in": ["t0", "i2"]},
    {"op": "Add", "in": ["t1", "i3"]},
    {"op": "Relu", "in": ["t2"]}]}

# where(mask, x / sqrt(d), -inf) -> exp, two outputs one of them bool, a Cast in the middle
MASKED = {"inputs": 2, "outputs": ["t3", "t4"], "ops": [
    {"op": "Div", "in": ["i0", 8.0]},
    {"op": "Where", "in": ["i1", "t0", float("-inf")]},
    {"op": "Cast", "in": ["t1"], "attrs": {"to": DType.float16.value}},
    {"op": "Exp", "in": ["t2"]},
    {"op": "Not", "in": ["i1"]}]}

MISC = {"inputs": 2, "outputs": ["t8"], "ops": [
    {"op": "Sigmoid", "in": ["i0"]}, {"op": "Sub", "in": ["t0", "i1"]},
    {"op": "Abs", "in": ["t1"]}, {"op": "Sqrt", "in": ["t2"]},
    {"op": "Erf", "in": ["t3"]}, {"op": "Pow", "in": ["t4", "i1"]},
    {"op": "Max", "in": ["t5", "t0", -0.5]}, {"op": "Clip", "in": ["t6", -0.25, 0.75]},
    {"op": "Gelu", "in": ["t7"], "attrs": {"approximate": "tanh"}}]}


def _run(prog, inputs, out_dtypes, tactic=None):
    p = P.Program.from_json(prog)
    assert P.check(p) is None
    return P.run(p, inputs, out_dtypes, tactic), P.run_eager(p, inputs, out_dtypes)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_triton_pointwise_bias_gelu_last_dim_broadcast(dtype):
    x, b = randn(2, 3, 16, dtype=dtype), randn(16, dtype=dtype)
    (y,), _ = _run(BIAS_GELU, [x, b], [dtype])
    assert y.dtype == dtype
    assert_close(y, F.gelu(x.float() + b.float()))


def test_triton_pointwise_gelu_spelled_out_matches_tanh_gelu():
    x = randn(5, 33) * 3
    (y,), (e,) = _run(GELU_TANH_SPELLED, [x], [torch.float32], {"BLOCK": 64, "num_warps": 1})
    assert_close(y, F.gelu(x, approximate="tanh"))
    assert_close(y, e)


def test_triton_pointwise_per_channel_nchw_and_residual():
    x, r = randn(2, 3, 4, 5, dtype=torch.float16), randn(2, 3, 4, 5, dtype=torch.float16)
    scale, shift = randn(3, 1, 1, dtype=torch.float16), randn(3, 1, 1, dtype=torch.float16)
    (y,), _ = _run(SCALE_SHIFT_RES_RELU, [x, scale, shift, r], [torch.float16])
    want = torch.relu(x.float() * scale.float() + shift.float() + r.float())
    assert_close(y, want)


def test_triton_pointwise_strided_and_scalar_inputs():
    x = randn(6, 4).t()  # not contiguous: read through its strides
    scale, shift = randn(1), torch.tensor(0.5, device=DEVICE)
    (y,), _ = _run(SCALE_SHIFT_RES_RELU, [x, scale, shift, randn(4, 6)], [torch.float32])
    assert y.is_contiguous()


def test_triton_pointwise_where_cast_and_bool_output():
    x = randn(3, 8) * 4
    mask = torch.rand(3, 8, device=DEVICE) > 0.3
    (y, nm), (ey, enm) = _run(MASKED, [x, mask], [torch.float16, torch.bool])
    assert y.dtype == torch.float16 and nm.dtype == torch.bool
    assert torch.equal(nm.cpu(), (~mask).cpu())
    want = torch.where(mask, (x / 8).half().float().exp(), torch.zeros(()).to(DEVICE))
    assert_close(y, want, dtype=torch.float16)
    assert_close(y, ey, dtype=torch.float16)


def test_triton_pointwise_misc_ops_match_eager():
    x, e = randn(4, 9), torch.rand(4, 9, device=DEVICE) * 2
    (y,), (want,) = _run(MISC, [x, e], [torch.float32])
    assert_close(y, want)


def test_triton_pointwise_compiles_once_per_signature():
    p = P.Program.from_json(BIAS_GELU)
    a = P.generate(p, ("f", (False, True)), (False, False), 2)
    b = P.generate(p, ("f", (False, True)), (False, False), 2)
    c = P.generate(p, ("f", "s"), (False, False), 2)
    assert a == b and a != c
    assert P.compile_source(a) is P.compile_source(b)


def test_no_triton_pointwise_for_unknown_op():
    p = P.Program.from_json({"inputs": 1, "outputs": ["t0"],
                             "ops": [{"op": "Mod", "in": ["i0", 2.0]}]})
    assert P.check(p) == "op Mod"


def test_triton_pointwise_fused_op_kernel():
    # FusedPointwise's own form: [op, [refs]] steps, constants as inputs, the last step out
    steps = [["Sub", ["i1", "i0"]], ["Mul", ["s0", "i2"]], ["Add", ["s1", "i3"]],
             ["Sigmoid", ["s2"]]]
    x, bias = randn(2, 4, 16, dtype=torch.float16), randn(16, dtype=torch.float16)
    one, big = (torch.tensor(v, dtype=torch.float16, device=DEVICE) for v in (1.0, -10.0))
    n = call(FT.FusedPointwise, program=json.dumps(steps))
    n.n_in, n.out_types = 4, (TensorType(DType.float16, (2, 4, 16)),)
    assert P.supports(n, (x, one, big, bias))
    y = P.fused_pointwise(n, x, one, big, bias)
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert_close(y, torch.sigmoid((1 - x.float()) * -10 + bias.float()))


@gpu
@pytest.mark.gpu
def test_triton_pointwise_gpu_bias_gelu_bert_ffn():
    x = randn(8192, 3072, dtype=torch.float16, device="cuda")
    b = randn(3072, dtype=torch.float16, device="cuda")
    p = P.Program.from_json(BIAS_GELU)
    for t in P.TACTICS:
        (y,) = P.run(p, [x, b], [torch.float16], t)
        assert_close(y, F.gelu(x.float() + b.float()))


def test_triton_supports_checks_never_call_torch_broadcast_shapes():
    """torch.broadcast_shapes' first call imports torch's symbolic shapes (0.17 s of a fresh
    process's first run on the H200): the CUDA kernels' support checks broadcast without it."""
    from kiln.kernels.triton import attention, pointwise

    for mod in (pointwise, attention):
        src = open(mod.__file__).read()
        assert "torch.broadcast_shapes(" not in src, mod.__name__


def test_triton_pointwise_attention_mask_program():
    """The [And, Where] program CUDA builds fuse from HF's SDPA mask: bool inputs that
    broadcast ([B, 1, Sq, 1] & [B, 1, 1, Sk]), fp16 constants, an fp16 [B, 1, Sq, Sk] out;
    the same as the PyTorch kernel's program."""
    from kiln.kernels.torch import fused_transformer as torch_ft

    steps = [["And", ["i0", "i1"]], ["Where", ["s0", "i2", "i3"]]]
    q = torch.rand(2, 1, 6, 1, device=DEVICE) > 0.3
    k = torch.rand(2, 1, 1, 7, device=DEVICE) > 0.3
    zero, neg = (torch.tensor([v], dtype=torch.float16, device=DEVICE) for v in (0.0, -1e4))
    n = call(FT.FusedPointwise, program=json.dumps(steps))
    n.n_in, n.out_types = 4, (TensorType(DType.float16, (2, 1, 6, 7)),)
    assert P.supports(n, (q, k, zero, neg))
    y = P.fused_pointwise(n, q, k, zero, neg)
    want = torch_ft.fused_pointwise(call(FT.FusedPointwise, program=json.dumps(steps)),
                                    q, k, zero, neg)
    assert y.dtype == torch.float16 and y.shape == (2, 1, 6, 7)
    torch.testing.assert_close(y.cpu(), want.cpu(), atol=0, rtol=0)
    assert (y == 0).sum() == (q & k).sum()
