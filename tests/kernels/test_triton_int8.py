"""Triton INT8 GEMM (Int8MatMul on CUDA) against the exact integer reference; runs on a GPU or
under TRITON_INTERPRET=1 on small shapes."""

import numpy as np
import pytest
import torch

from tests.kernels.triton_util import DEVICE, INTERPRET

if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from kiln.kernels.registry import Call
from kiln.kernels.triton import int8_gemm as T
from kiln.ops import int8 as I8
from kiln.passes.quantize.int8 import quantize_weight


def _reference(x, wq, ws, b, r, s, z, act):
    codes = np.clip(np.floor(x / s + 0.5) + z, 0, 255) - z
    y = (codes.astype(np.int64) @ wq.astype(np.int64)) * (s * ws)
    y = y + (0 if b is None else b) + (0 if r is None else r)
    return np.maximum(y, 0) if act == "Relu" else y


@pytest.mark.parametrize("m,k,n,zero,act,bias,res", [
    (16, 32, 16, 128, "", False, False),
    (20, 40, 24, 128, "Relu", True, False),  # ragged M, K, N
    (33, 64, 16, 61, "", True, True),  # asymmetric zero point, residual
])
def test_triton_int8_matmul(m, k, n, zero, act, bias, res):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wq, ws = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), 1)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((m, n)).astype(np.float32) if res else None
    s = float(np.abs(x).max() / 127)
    call = Call(I8.Int8MatMul.make_attrs(x_scale=s, x_zero=zero, activation=act,
                                         has_residual=int(res)), 1, 5,
                tactic=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2))

    def dev(a):
        return None if a is None else torch.from_numpy(a).to(DEVICE)

    got = T.triton_int8_matmul(call, dev(x), dev(wq), dev(ws), dev(b), dev(r))
    want = _reference(x, wq, ws, b, r, s, zero, act)
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def _int8_codes(x, s, z):
    """X's signed int8 codes as kiln's kernels write them: floor(x / s + 0.5) + z - 128."""
    return np.clip(np.floor(x / s + 0.5) + z, 0, 255).astype(np.int64) - 128


def _dev(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


@pytest.mark.parametrize("x_codes,out_codes", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_int8_matmul_handoff(x_codes, out_codes, dtype):
    """Codes in (the producer quantized X) and/or codes out (the reader's scale): the same
    integers as the float path, the output quantized by its reader's scale and zero."""
    m, k, n, zero = 24, 64, 40, 100
    rng = np.random.default_rng(7)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wq, ws = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), 1)
    b = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    s = float(np.abs(x).max() / 127)
    want = _reference(x, wq, ws, b, r, s, zero, "Relu")
    os_, oz = float(want.max() / 255), 0
    fdt = {torch.float32: 1, torch.float16: 10}[dtype]
    call = Call(I8.Int8MatMul.make_attrs(
        x_scale=s, x_zero=zero, activation="Relu", has_residual=1,
        out_scale=os_ if out_codes else 0.0, out_zero=oz, out_float=fdt), 1, 5,
        tactic=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2))
    xin = _dev(_int8_codes(x, s, zero).astype(np.int8)) if x_codes else _dev(x).to(dtype)
    got = T.triton_int8_matmul(call, xin, _dev(wq), _dev(ws), _dev(b).to(dtype),
                               _dev(r).to(dtype))
    if out_codes:
        assert got.dtype == torch.int8
        wc = _int8_codes(want, os_, oz)
        d = np.abs(got.cpu().numpy().astype(np.int64) - wc)
        assert d.max() <= 1 and (d == 0).mean() > 0.97  # +-1 where fp16 rounding moved a half
    else:
        assert got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-3
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=tol,
                                   atol=tol * np.abs(want).max())


def _e4m3(a):
    import ml_dtypes

    return np.asarray(a, np.float32).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("x_codes,out_codes,k", [(False, False, 64), (True, False, 64),
                                                 (False, True, 40), (True, True, 40)])
def test_triton_fp8_matmul(x_codes, out_codes, k):
    """FP8: X quantized in the kernel (round to nearest even, saturating) or given as e4m3
    codes, e4m3 weights per column, fp32 accumulation, the epilogue, e4m3 codes out."""
    from kiln.passes.quantize.int8 import quantize_weight_fp8

    m, n = 20, 24
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    x[0, 0] = 1e4  # saturates at 448 * s
    wf8, ws = quantize_weight_fp8(rng.standard_normal((k, n)).astype(np.float32))
    b = rng.standard_normal(n).astype(np.float32)
    s = float(np.abs(x[1:]).max() / 448)
    xq = np.clip(x / np.float32(s), -448, 448)
    codes = _e4m3(xq)
    want = (codes.astype(np.float32).astype(np.float64) @ wf8.astype(np.float32)) * (s * ws) + b
    want = 0.5 * want * (1 + np.vectorize(__import__("math").erf)(want / np.sqrt(2)))
    os_ = float(np.abs(want).max() / 448)
    call = Call(I8.Fp8MatMul.make_attrs(x_scale=s, activation="Gelu",
                                        out_scale=os_ if out_codes else 0.0, out_float=1),
                1, 4, tactic=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2))
    wt = _dev(wf8.view(np.uint8)).view(torch.float8_e4m3fn)
    xin = _dev(codes.view(np.uint8)).view(torch.float8_e4m3fn) if x_codes else _dev(x)
    got = T.triton_fp8_matmul(call, xin, wt, _dev(ws), _dev(b))
    if out_codes:
        assert got.dtype == torch.float8_e4m3fn
        g = got.float().cpu().numpy()
        wc = _e4m3(np.clip(want / os_, -448, 448)).astype(np.float32)
        assert np.abs(g - wc).max() <= 2 ** -3 * np.abs(wc).max() + 1e-6  # one e4m3 step
        assert (g == wc).mean() > 0.9
    else:
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4,
                                   atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("fp8,block", [(False, 64), (True, 64), (False, 16)])
def test_triton_layer_norm_quant(fp8, block):
    """LayerNormQuant: the float output as LayerNormalization's, and its codes y * qmul
    (one-block rows and rows walked in chunks)."""
    from kiln.kernels.torch import int8 as TI
    from kiln.kernels.triton import norm as TN

    rng = np.random.default_rng(5)
    rows, c = 6, 48
    x = rng.standard_normal((rows, c)).astype(np.float32) * 2 + 1
    g = rng.uniform(0.5, 1.5, c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32) * 0.1
    mean = x.mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b
    s = float(np.abs(y).max() / (448 if fp8 else 127))
    qm = (rng.uniform(0.5, 2.0, c) / s).astype(np.float32) / 2  # smoothing x 1 / scale
    call = Call(I8.LayerNormQuant.make_attrs(epsilon=1e-5, zshift=-3, fp8=int(fp8)), 2, 4,
                tactic=dict(BLOCK=block, num_warps=1))
    got_y, got_q = TN.layer_norm_quant(call, _dev(x), _dev(g), _dev(b), _dev(qm))
    np.testing.assert_allclose(got_y.cpu().numpy(), y, rtol=1e-4, atol=1e-4)
    ref_y, ref_q = TI.layer_norm_quant(call, _dev(x), _dev(g), _dev(b), _dev(qm))
    if fp8:
        want = _e4m3(np.clip(y * qm, -448, 448)).astype(np.float32)
        assert got_q.dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(got_q.float().cpu().numpy(), want)
    else:
        want = np.clip(np.floor(y * qm + 0.5) - 3, -128, 127)
        assert got_q.dtype == torch.int8
        assert np.abs(got_q.cpu().numpy() - want).max() <= 1
        assert (got_q.cpu().numpy() == want).mean() > 0.97
    assert np.abs(ref_q.float().cpu().numpy() - got_q.float().cpu().numpy()).max() <= (
        2 ** -3 * np.abs(want).max() if fp8 else 1)


@pytest.mark.parametrize("fp8,x_codes,out_codes", [(False, False, False), (False, True, True),
                                                   (True, False, False), (True, True, True)])
def test_fp16_tactic_computes_the_quantized_layer(fp8, x_codes, out_codes):
    """The FP16 candidate (Fp16Q8MatMul): the same layer as the 8-bit kernel to FP16
    rounding, in every hand-off form, so the autotuner's check against the PyTorch kernel
    passes and it can be picked where it is faster."""
    from kiln.kernels.registry import kernels_for

    rng = np.random.default_rng(11)
    m, k, n = 32, 64, 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    if fp8:
        from kiln.passes.quantize.int8 import quantize_weight_fp8

        w, ws = quantize_weight_fp8(rng.standard_normal((k, n)).astype(np.float32))
        wt = _dev(w.view(np.uint8)).view(torch.float8_e4m3fn)
        op, s, zero = I8.Fp8MatMul, float(np.abs(x).max() / 448), 128
        attrs = dict(x_scale=s)
        xin = _dev(_e4m3(np.clip(x / s, -448, 448)).view(np.uint8)).view(
            torch.float8_e4m3fn) if x_codes else _dev(x).half()
    else:
        w, ws = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), 1)
        wt = _dev(w)
        op, s, zero = I8.Int8MatMul, float(np.abs(x).max() / 127), 120
        attrs = dict(x_scale=s, x_zero=zero)
        xin = _dev(_int8_codes(x, s, zero).astype(np.int8)) if x_codes else _dev(x).half()
    b = _dev(rng.standard_normal(n).astype(np.float32)).half()
    out_scale = 0.05 if out_codes else 0.0
    (k16,) = [kk for kk in kernels_for(op, "cuda") if kk.name == "Fp16Q8MatMul"]
    (k8,) = [kk for kk in kernels_for(op, "cuda") if kk.name.startswith("Triton")]
    call = Call(op.make_attrs(activation="Relu", out_scale=out_scale, out_float=10, **attrs),
                1, 4, tactic=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2))
    space = k16.tactic_space(call, (xin, wt, _dev(ws), b))
    assert k16.can_run(call, (xin, wt, _dev(ws), b))
    want = k8.fn(call, xin, wt, _dev(ws), b)
    for t16 in (space[0], space[-1]):  # a Triton FP16 tile, cuBLAS + the epilogue kernel
        got = k16.fn(Call(call.attrs, 1, 4, tactic=dict(t16)), xin, wt, _dev(ws), b)
        assert got.dtype == want.dtype
        if out_codes:
            d = (got.float() - want.float()).abs().cpu().numpy()
            assert d.max() <= (2 ** -3 * want.float().abs().max().item() if fp8 else 1)
        else:
            np.testing.assert_allclose(got.float().cpu().numpy(), want.float().cpu().numpy(),
                                       rtol=1e-2, atol=2e-3 * want.float().abs().max().item())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("int8_faster", [True, False])
def test_autotune_weighs_the_fp16_tactic(fp8, int8_faster):
    """The autotuner's candidates for an 8-bit layer include the FP16 tactic; every candidate
    passes its check against the PyTorch kernel (also with codes in and out), and the one the
    timer rates fastest is kept: an 8-bit kernel slower than FP16 is not picked blindly."""
    import dataclasses

    from kiln.builder import autotune

    rng = np.random.default_rng(2)
    m, k, n = 32, 64, 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    if fp8:
        from kiln.passes.quantize.int8 import quantize_weight_fp8

        w, ws = quantize_weight_fp8(rng.standard_normal((k, n)).astype(np.float32))
        wt, op = _dev(w.view(np.uint8)).view(torch.float8_e4m3fn), I8.Fp8MatMul
        s = float(np.abs(x).max() / 448)
        xin = _dev(_e4m3(np.clip(x / s, -448, 448)).view(np.uint8)).view(torch.float8_e4m3fn)
        attrs = dict(x_scale=s)
    else:
        w, ws = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), 1)
        wt, op, s = _dev(w), I8.Int8MatMul, float(np.abs(x).max() / 127)
        xin = _dev(_int8_codes(x, s, 128).astype(np.int8))
        attrs = dict(x_scale=s, x_zero=128)
    call = Call(op.make_attrs(activation="Gelu", out_scale=0.02, out_float=10, **attrs), 1, 4)
    ins = (xin, wt, _dev(ws), _dev(rng.standard_normal(n).astype(np.float32)).half())
    cands = autotune.candidates(op, call, ins)
    names = {c.kernel.name for c in cands}
    assert {"Fp16Q8MatMul", "TritonFp8MatMul" if fp8 else "TritonInt8MatMul"} <= names
    ran = []

    def mark(kernel):
        def fn(*a, _f=kernel.fn, _name=kernel.name):
            ran.append(_name)
            return _f(*a)
        return dataclasses.replace(kernel, fn=fn)

    few = []  # two tactics per kernel (the interpreter is slow), the PyTorch kernel
    for name in sorted(names):
        few += [autotune.Candidate(mark(c.kernel), c.tactic)
                for c in cands if c.kernel.name == name][:2]

    def timer(fn):
        ran.clear()
        fn()
        name = ran[-1]
        if name.startswith(("Torch", "Cuda")):  # emulation, torch._int_mm / _scaled_mm
            return 5.0
        return 1.0 if name.startswith("Triton") == int8_faster else 2.0

    sel = autotune.select("layer", op, call, ins, few, timer)
    assert sel.failed == []
    assert sel.kernel == ("Triton" + op.name if int8_faster else "Fp16Q8MatMul")
