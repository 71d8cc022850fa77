"""Casts and quantization ops against onnx.reference (or NumPy where the reference is loose)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import sympy
import torch
from onnx import TensorProto

from kiln.errors import KernelError
from kiln.ir import DType, InferCtx, TensorType, sym
from kiln.ops import quant as Q
from tests.ops.harness import assert_close, check_against_reference, node_model, run_kiln

RNG = np.random.default_rng(0)
X = np.concatenate([RNG.standard_normal(40).astype(np.float32) * 100,
                    np.array([0.5, 1.5, 2.5, -0.5, 1e6, -1e6, 1e-7, 0.0], np.float32)])


def _cast(x, to, **attrs):
    return node_model("Cast", {"x": x}, to=to, **attrs)


@pytest.mark.parametrize("to", [
    TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.INT32,
    TensorProto.INT8, TensorProto.UINT8, TensorProto.BOOL, TensorProto.INT64,
    TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
    TensorProto.FLOAT8E5M2FNUZ, TensorProto.FLOAT4E2M1, TensorProto.INT4, TensorProto.UINT4,
    TensorProto.INT2, TensorProto.UINT2])
def test_cast_from_float(to):
    check_against_reference(_cast(X, to), {"x": X})


@pytest.mark.parametrize("to", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ,
                                TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ])
def test_cast_float8_no_saturate(to):
    x = np.array([1e6, -1e6, 448, 500, 60000, np.inf, -np.inf, 0.3], np.float32)
    got = run_kiln(_cast(x, to, saturate=0), {"x": x})[0]
    want = x.astype(DType.from_onnx(to).np)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_e8m0_round_modes(mode, saturate):
    x = np.array([0.0, 0.124, 0.75, 1.1, 3.0, 6.0, 1e38, 3e38, np.inf, np.nan], np.float32)
    model = _cast(x, TensorProto.FLOAT8E8M0, round_mode=mode, saturate=saturate)
    check_against_reference(model, {"x": x})


def test_cast_from_small_types():
    for np_dt in (ml_dtypes.int4, ml_dtypes.uint2, ml_dtypes.float4_e2m1fn,
                  ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16):
        x = np.array([0, 1, 2, 3, 1.5, -1], np.float32).astype(np_dt)
        for to in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT8):
            check_against_reference(_cast(x, to), {"x": x})


def test_cast_strings():
    x = np.array([0.1, -2.5, 1e6, 3.0], np.float32)
    got = run_kiln(_cast(x, TensorProto.STRING), {"x": x})[0]
    assert list(got) == ["0.1", "-2.5", "1e+06", "3.0"]
    s = np.array(["1.5", "-2", "NaN", "INF", "1e-3"], dtype=object)
    got = run_kiln(_cast(s, TensorProto.FLOAT), {"x": s})[0]
    assert_close(got, np.array([1.5, -2, np.nan, np.inf, 1e-3], np.float32))
    ints = np.array(["12", "-7", "9007199254740993"], dtype=object)
    got = run_kiln(_cast(ints, TensorProto.INT64), {"x": ints})[0]
    assert got.tolist() == [12, -7, 9007199254740993]


def test_cast_like():
    like = np.zeros(1, np.float16)
    check_against_reference(node_model("CastLike", {"x": X, "like": like}), {"x": X, "like": like})
    like8 = np.zeros(1, ml_dtypes.float8_e5m2)
    check_against_reference(node_model("CastLike", {"x": X, "like": like8}),
                            {"x": X, "like": like8})


def test_bitcast():
    x = np.array([1.0, -2.5, np.inf], np.float32)
    got = run_kiln(node_model("BitCast", {"x": x}, to=TensorProto.INT32), {"x": x})[0]
    np.testing.assert_array_equal(got, x.view(np.int32))
    with pytest.raises(KernelError, match="bit width"):
        run_kiln(node_model("BitCast", {"x": x}, to=TensorProto.INT64), {"x": x})


def _quant_inputs(x, scale, zp=None):
    d = {"x": x, "s": scale}
    if zp is not None:
        d["zp"] = zp
    return d


@pytest.mark.parametrize("zp", [
    np.array([10, 20, 30], np.uint8), np.array([-3, 0, 3], np.int8),
    np.array([1, 2, 3], np.uint16), np.array([-1, 0, 1], ml_dtypes.int4),
    np.array([0, 1, 2], ml_dtypes.uint4), np.zeros(3, ml_dtypes.float8_e4m3fn)])
def test_quantize_dequantize_per_axis(zp):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32) * 20
    ins = _quant_inputs(x, np.array([0.5, 1.0, 2.5], np.float32), zp)
    check_against_reference(node_model("QuantizeLinear", ins, axis=1), ins)
    q = x.astype(zp.dtype) if zp.dtype.kind == "V" else np.clip(x, 0, 3).astype(zp.dtype)
    dins = _quant_inputs(q, ins["s"], zp)
    check_against_reference(node_model("DequantizeLinear", dins, axis=1), dins)


def test_quantize_blocked_and_output_dtype():
    x = RNG.standard_normal((3, 5)).astype(np.float32) * 10
    scale = np.array([[1.0, 2.0, 3.0]] * 3, np.float32)
    ins = _quant_inputs(x, scale)
    check_against_reference(node_model("QuantizeLinear", ins, axis=1, block_size=2,
                                       output_dtype=TensorProto.INT8), ins)
    q = np.arange(15, dtype=np.int8).reshape(3, 5)
    dins = _quant_inputs(q, scale.astype(np.float16))
    check_against_reference(node_model("DequantizeLinear", dins, axis=1, block_size=2), dins)


def test_quantize_bad_inputs():
    x = np.ones((2, 4), np.float32)
    ins = _quant_inputs(x, np.ones(2, np.float32), np.zeros(2, np.uint8))
    with pytest.raises(KernelError, match="output_dtype"):
        run_kiln(node_model("QuantizeLinear", ins, axis=0, output_dtype=TensorProto.INT8), ins)
    ins = _quant_inputs(x, np.ones(3, np.float32))
    with pytest.raises(KernelError, match="does not match"):
        run_kiln(node_model("QuantizeLinear", ins, axis=1), ins)


def test_dynamic_quantize_linear():
    for x in (X, np.abs(X), -np.abs(X)):
        check_against_reference(node_model("DynamicQuantizeLinear", {"x": x}, n_out=3), {"x": x})


def test_matmul_integer_per_row_zero_points():
    a = RNG.integers(0, 255, (2, 3, 300), dtype=np.uint8)  # K > 256: the float64 path
    b = RNG.integers(-128, 127, (300, 5), dtype=np.int8)
    azp, bzp = np.array([3, 7, 9], np.uint8), np.array([1, -2, 0, 4, 5], np.int8)
    ins = {"a": a, "b": b, "azp": azp, "bzp": bzp}
    got = run_kiln(node_model("MatMulInteger", ins), ins)[0]
    want = (a.astype(np.int64) - azp[:, None]) @ (b.astype(np.int64) - bzp)
    np.testing.assert_array_equal(got, want.astype(np.int32))


@pytest.mark.parametrize("kind", ["extreme", "typical"])
def test_matmul_integer_exact_where_float32_rounds(kind):
    """Codes 255 against weights 0 with zero point 255 (every product -65025, 1024 of them:
    4x past float32's 2**24) need several exact chunks; typical weights one. Both equal int64
    math to the bit."""
    from kiln.kernels.torch.quant_linear import exact_chunks

    k = 1024
    a = np.full((3, k), 255, np.uint8)
    a[1] = RNG.integers(0, 256, k)
    if kind == "extreme":
        b, bzp = np.zeros((k, 7), np.uint8), np.array(255, np.uint8)
        b[::3, 1] = 1  # a near-worst column whose true sum is not a multiple of a power of 2
    else:
        b, bzp = RNG.integers(100, 140, (k, 7)).astype(np.uint8), np.array(119, np.uint8)
    ins = {"a": a, "b": b, "azp": np.array(0, np.uint8), "bzp": bzp}
    got = run_kiln(node_model("MatMulInteger", ins), ins)[0]
    want = a.astype(np.int64) @ (b.astype(np.int64) - int(bzp))
    np.testing.assert_array_equal(got, want.astype(np.int32))
    chunks = exact_chunks(torch.from_numpy(np.abs(b.astype(np.float32) - float(bzp))))
    assert (len(chunks) > 1) == (kind == "extreme")
    assert sum(size for _, size in chunks) == k
    # the reason for chunks: one float32 GEMM over all of K rounds these sums
    one = (a.astype(np.float32) @ (b.astype(np.float32) - float(bzp))).astype(np.int64)
    assert (kind == "typical") == np.array_equal(one, want)


def test_conv_integer_exact_where_float32_rounds():
    x = np.full((1, 300, 3, 3), 255, np.uint8)
    w = np.zeros((2, 300, 3, 3), np.uint8)
    w[1, ::7] = 3
    ins = {"x": x, "w": w, "xzp": np.array([0], np.uint8), "wzp": np.array([255], np.uint8)}
    got = run_kiln(node_model("ConvInteger", ins, pads=[1, 1, 1, 1]), ins)[0]
    check_against_reference(node_model("ConvInteger", ins, pads=[1, 1, 1, 1]), ins)
    assert got[0, 0, 1, 1] == -255 * 255 * 300 * 9


@pytest.mark.parametrize("attrs", [
    {}, {"pads": [1, 0, 2, 1]}, {"strides": [2, 1], "dilations": [1, 2]},
    {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, {"group": 2}, {"channels": 40},
    {"channels": 64, "group": 2}])
def test_conv_integer(attrs):
    c = attrs.pop("channels", 4)  # 40 * 3 * 3 > 256 terms: accumulated over channel chunks
    x = RNG.integers(0, 255, (1, c, 7, 6), dtype=np.uint8)
    w = RNG.integers(0, 255, (4, c // attrs.get("group", 1), 3, 3), dtype=np.uint8)
    ins = {"x": x, "w": w, "xzp": np.array([17], np.uint8)}
    check_against_reference(node_model("ConvInteger", ins, **attrs), ins)


def test_qlinear_conv_bias_per_channel():
    x = RNG.integers(0, 255, (1, 2, 5, 5), dtype=np.uint8)
    w = RNG.integers(-128, 127, (3, 2, 3, 3), dtype=np.int8)
    ins = {"x": x, "xs": np.array(0.02, np.float32), "xzp": np.array(128, np.uint8), "w": w,
           "ws": np.array([0.01, 0.02, 0.03], np.float32), "wzp": np.zeros(3, np.int8),
           "ys": np.array(0.5, np.float32), "yzp": np.array(5, np.uint8),
           "b": np.array([100, -200, 3000], np.int32)}
    ins = {k: v.reshape(-1) if v.ndim == 0 else v for k, v in ins.items()}  # 1-element params
    check_against_reference(node_model("QLinearConv", ins, pads=[1, 1, 1, 1]), ins)


@pytest.mark.parametrize("dt", [np.uint8, np.int8])
def test_qlinear_matmul_3d(dt):
    lo, hi = (0, 255) if dt == np.uint8 else (-128, 127)
    a = RNG.integers(lo, hi, (2, 3, 4), dtype=dt)
    b = RNG.integers(lo, hi, (4, 5), dtype=dt)
    one = np.ones(1, np.float32)
    ins = {"a": a, "as": one * 0.05, "azp": np.array([3], dt), "b": b, "bs": one * 0.02,
           "bzp": np.array([1], dt), "ys": one * 0.3, "yzp": np.array([7], dt)}
    check_against_reference(node_model("QLinearMatMul", ins), ins)


def _ctx(op, in_types, attrs, syms=None):
    return InferCtx(op.make_attrs(**attrs), in_types, [None] * len(in_types),
                    syms or [None] * len(in_types), 1)


def test_rules_symbolic():
    n, h = sym("n"), sym("h")
    ctx = _ctx(Q.QLinearConv, [TensorType(DType.uint8, (n, 3, h, 8))] + [None] * 2
               + [TensorType(DType.int8, (16, 3, 3, 3))] + [None] * 3
               + [TensorType(DType.uint8, ())], {"strides": (2, 2), "pads": (1, 1, 1, 1)})
    (t,) = Q.QLinearConv.infer(ctx)
    assert t.dtype == DType.uint8 and t.shape[:2] == (n, 16) and t.shape[3] == 4
    assert sympy.simplify(t.shape[2] - (sympy.floor((h - 1) / 2) + 1)) == 0
    ctx = _ctx(Q.Cast, [TensorType(DType.int64, (2,))], {"to": TensorProto.INT32},
               [(n, h)])
    (t,) = Q.Cast.infer(ctx)
    assert t == TensorType(DType.int32, (2,)) and ctx.out_syms == [(n, h)]
    ctx = _ctx(Q.MatMulInteger, [TensorType(DType.uint8, (n, h, 8)),
                                 TensorType(DType.int8, (8, 5))], {})
    assert Q.MatMulInteger.infer(ctx) == [TensorType(DType.int32, (n, h, 5))]
    ctx = _ctx(Q.Cast, [TensorType(DType.float32, (n,))], {"to": "FLOAT16"})  # Cast-1 form
    assert Q.Cast.infer(ctx) == [TensorType(DType.float16, (n,))]


def test_matmul_integer_u8_weights_split_exact(monkeypatch):
    """uint8 weights with a zero point (codes - zp in -119..136) on the CPU run as two FBGEMM
    u8s8 GEMMs (l + 128 h, neither can saturate): the exact integers, raw codes up to 255."""
    from kiln.kernels.torch import int8 as K
    from kiln.kernels.torch import quant_linear as QL

    if not K._HAS_FBGEMM:
        pytest.skip("needs PyTorch's FBGEMM")
    a = RNG.integers(0, 256, (5, 256)).astype(np.uint8)
    a[0] = 255
    b = RNG.integers(0, 256, (256, 40)).astype(np.uint8)
    b[:, 0] = 0
    cache, calls = {}, []
    split = QL._int_matmul_u8_split
    monkeypatch.setattr(QL, "_int_matmul_u8_split", lambda *a: calls.append(1) or split(*a))
    monkeypatch.setattr(QL, "_qgemm_weight", lambda b, z: None)  # FBGEMM's path, not qgemm's
    t = torch.from_numpy
    got = QL.int_matmul(t(a), t(b), t(np.array(3, np.uint8)), t(np.array(119, np.uint8)), cache)
    assert len(cache["int_matmul_w"][2][2]) == 2 and calls  # both pieces, FBGEMM's path
    want = (a.astype(np.int64) - 3) @ (b.astype(np.int64) - 119)
    np.testing.assert_array_equal(got.numpy(), want)
    bt = t(b)
    QL.int_matmul(t(a), bt, None, None, cache)
    bt[:, 1] = 7  # the same tensor written in place (an activation buffer): not the cache's
    again = QL.int_matmul(t(a), bt, None, None, cache).numpy()
    np.testing.assert_array_equal(again, a.astype(np.int64) @ bt.numpy().astype(np.int64))


@pytest.mark.parametrize("path", ["scalar", "avx2", "vnni"])
@pytest.mark.parametrize("wdtype,wz", [("uint8", 119), ("uint8", 128), ("int8", 0),
                                       ("int8", 5)])
def test_matmul_integer_on_qgemm_exact(path, wdtype, wz, monkeypatch):
    """MatMulInteger of uint8 codes by a constant 8-bit weight on kiln's qgemm (each path):
    int8 codes minus zero point as they are, uint8 ones beyond int8 shifted by 128 with the
    rows' code sums times the offset added back: the exact integers."""
    from kiln import native
    from kiln.kernels.torch import int8 as K
    from kiln.kernels.torch import quant_linear as QL

    if not native.available or path not in native.qgemm_paths():
        pytest.skip(f"no native {path} path")
    monkeypatch.setenv("KILN_QGEMM_PATH", path)
    monkeypatch.setattr(K, "u8s8_saturates", lambda: False)
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, (2, 7, 75)).astype(np.uint8)
    a[0, 0] = 255
    lo, hi = (0, 256) if wdtype == "uint8" else (-128 + wz, 128)
    b = rng.integers(lo, hi, (75, 30)).astype(wdtype)
    cache, t = {}, torch.from_numpy
    got = QL.int_matmul(t(a), t(b), t(np.array(9, np.uint8)), t(np.array(wz, wdtype)), cache)
    w, off = cache["int_matmul_qgemm"][2]
    assert w.path == path and (off is None) == (wdtype == "int8" or wz == 128)
    want = (a.astype(np.int64) - 9) @ (b.astype(np.int64) - wz)
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("wdtype,zp", [("uint8", "column"), ("int8", "column"),
                                       ("uint8", None), ("int8", None)])
def test_matmul_integer_on_qgemm_per_column_and_no_zero_point(wdtype, zp, monkeypatch):
    """The qgemm weight's codes from a zero point per column, or none: the exact integers
    (uint8 codes whose range minus the column's zero point passes int8 are shifted by 128),
    and QGemmWeight's column sums are the int8 codes' own."""
    from kiln import native
    from kiln.kernels.torch import int8 as K
    from kiln.kernels.torch import quant_linear as QL

    if not native.available:
        pytest.skip("no native library")
    monkeypatch.setattr(K, "u8s8_saturates", lambda: False)
    rng = np.random.default_rng(13)
    a = rng.integers(0, 256, (6, 70)).astype(np.uint8)
    lo, hi = (0, 256) if wdtype == "uint8" else (-128, 128)
    b = rng.integers(lo, hi, (70, 33)).astype(wdtype)
    z = None if zp is None else rng.integers(0 if wdtype == "uint8" else -20,
                                             256 if wdtype == "uint8" else 20, 33).astype(wdtype)
    if wdtype == "int8" and z is not None:
        b = np.clip(b.astype(np.int16), -108, 107).astype(np.int8)  # b - z within int8
    cache, t = {}, torch.from_numpy
    got = QL.int_matmul(t(a), t(b), t(np.array(4, np.uint8)), None if z is None else t(z), cache)
    w, off = cache["int_matmul_qgemm"][2]
    want = (a.astype(np.int64) - 4) @ (b.astype(np.int64) - (0 if z is None else
                                                             z.astype(np.int64)))
    np.testing.assert_array_equal(got.numpy(), want)
    shifted = b.astype(np.int64) - (0 if z is None else z.astype(np.int64))
    codes = shifted if off is None else shifted - off.numpy()
    assert codes.min() >= -128 and codes.max() <= 127
    np.testing.assert_array_equal(w.colsum.numpy(), codes.sum(0))
    assert (off is None) == (wdtype == "int8" or shifted.min() >= -128 and shifted.max() <= 127)


def test_matmul_integer_qgemm_not_on_saturating_full_range_int8(monkeypatch):
    """Must not fire: int8 weights beyond the 7-bit grid where the CPU's u8s8 GEMMs saturate
    (onnxruntime's integers there are the saturated ones, not qgemm's)."""
    from kiln.kernels.torch import int8 as K
    from kiln.kernels.torch import quant_linear as QL

    monkeypatch.setattr(K, "u8s8_saturates", lambda: True)
    b = torch.from_numpy(np.random.default_rng(12).integers(-128, 128, (16, 8)).astype(np.int8))
    assert QL._qgemm_weight(b, None) is None
    assert QL._qgemm_weight(b // 4, None) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_matmul_integer_on_cuda_matches_the_cpu():
    """On CUDA the weight is on the device: no FBGEMM pieces (CPU tensors) are made for it
    (was 'Unsupported qscheme: per_channel_affine' in ONNX's test_matmulinteger on CUDA)."""
    from kiln.kernels.torch.quant_linear import int_matmul

    rng = np.random.default_rng(0)
    a = torch.from_numpy(rng.integers(0, 256, (4, 16), dtype=np.uint8))
    b = torch.from_numpy(rng.integers(0, 256, (16, 8), dtype=np.uint8))
    za, zb = torch.tensor(12, dtype=torch.uint8), torch.tensor(200, dtype=torch.uint8)
    want = int_matmul(a, b, za, zb, {})
    got = int_matmul(a.cuda(), b.cuda(), za.cuda(), zb.cuda(), {})
    assert torch.equal(got.cpu(), want)
