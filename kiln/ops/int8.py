"""INT8 layers kiln's quantizer creates (kiln.passes.quantize.int8) from float ones.

Both compute ``act(dequant(quant(X) * Wq) + bias + R)``: the activation X is quantized per
tensor with the calibrated ``x_scale`` and ``x_zero`` (uint8 codes ``round(X / x_scale) +
x_zero``), the weight is stored quantized per output channel (``Wq`` int8, ``w_scale`` float32
per channel), the products accumulate in int32, and the epilogue (dequantize, bias, residual,
activation) runs on the float result. The output is float32, as the layer's was.
"""

from __future__ import annotations

from kiln.ir import DType
from kiln.ir.opdef import REQUIRED, Attr
from kiln.ops.fused_conv import _CONV_ATTRS, _EPILOGUE
from kiln.ops.nn import _conv_rule, _matmul_rule
from kiln.ops.quant import ConvInteger, conv_shape
from kiln.ops.rules import same, tensor
from kiln.ops.schema import kiln_op

# x_scale 0: the activation is quantized on every call from its own range (dynamic)
_QUANT = {"x_scale": Attr("float", REQUIRED), "x_zero": Attr("int", 0)}

# Quantized hand-offs between layers (kiln.passes.quantize.handoff, CUDA builds): a layer whose
# X input is already codes (int8 for Int8MatMul/Int8Conv: ``clamp(round(x / x_scale) + x_zero
# - 128, -128, 127)``; float8 e4m3 for Fp8MatMul: ``x / x_scale`` saturated at 448) computes in
# the float dtype ``out_float`` (an ONNX dtype code; 0: X's dtype); one with ``out_scale`` > 0
# writes its own output as such codes (``out_scale``, ``out_zero``: its reader's x_scale and
# x_zero) instead of the float values.
_QOUT = {"out_scale": Attr("float", 0.0), "out_zero": Attr("int", 128),
         "out_float": Attr("int", 0)}
CODE_DTYPES = (DType.int8, DType.float8e4m3fn)


def _handoff(rule, codes: DType):
    """``rule``'s shape with the dtype of the hand-off attributes (see :data:`_QOUT`)."""
    def infer(ctx):
        out = rule(ctx)
        a = ctx.attrs
        if a.out_scale > 0:
            dt = codes
        elif ctx.dtype(0) in CODE_DTYPES:
            dt = DType(a.out_float) if a.out_float else None
        else:
            return out
        return [tensor(dt, out[0].shape)]
    return infer

Int8MatMul = kiln_op(
    "Int8MatMul", {**_QUANT, **_EPILOGUE, **_QOUT}, _handoff(_matmul_rule, DType.int8),
    doc="act(X @ (Wq * w_scale) + bias + R) with X quantized by x_scale/x_zero; inputs X "
        "(float, N-D), Wq (int8 [K, N]), w_scale (float32 [N]), bias (optional), R (optional)")

Int8MatMulQDQ = kiln_op(
    "Int8MatMulQDQ", {**_QUANT, "y_scale": Attr("float", REQUIRED), "y_zero": Attr("int", 0),
                      "y_signed": Attr("int", 1)}, _matmul_rule,
    doc="Int8MatMul (no bias, residual or activation) whose output is quantized and "
        "dequantized again as onnxruntime's QLinearMatMul requantizes it: codes "
        "round(acc * (x_scale * w_scale / y_scale)) + y_zero from the int32 products acc, "
        "saturated to int8 (y_signed) or uint8, back in float32 by y_scale; inputs X, Wq, "
        "w_scale")

QLinearMatMulQDQ = kiln_op(
    "QLinearMatMulQDQ", {f"{t}_{f}": a for t in ("a", "b", "y") for f, a in (
        ("scale", Attr("float", REQUIRED)), ("zero", Attr("int", 0)), ("signed", Attr("int", 0)))},
    _matmul_rule,
    doc="QDQ's DQ(Q(A)) @ DQ(Q(B)) -> Q -> DQ of two activations (attention's Q K^T and P V "
        "in a QDQ model) as onnxruntime's QLinearMatMul computes it: A's and B's 8-bit codes "
        "(a_/b_ scale, zero, signed: QuantizeLinear's steps), exact int32 products of the "
        "codes minus their zero points, requantized by float32(a_scale * b_scale) / y_scale "
        "(round half to even, saturated to y's int8 or uint8) and returned dequantized "
        "(float32); inputs A [..., M, K], B [..., K, N] (float32)")

Int8Conv = kiln_op(
    "Int8Conv", {**_QUANT, **_CONV_ATTRS, **_EPILOGUE, **_QOUT},
    _handoff(_conv_rule, DType.int8),
    doc="act(Conv(X, Wq * w_scale) + bias + R) with X quantized by x_scale/x_zero; inputs X, "
        "Wq (int8 [M, C/group, k...]), w_scale (float32 [M]), bias (optional), R (optional)")

Fp8MatMul = kiln_op(
    "Fp8MatMul", {"x_scale": Attr("float", REQUIRED), **_EPILOGUE, **_QOUT},
    _handoff(_matmul_rule, DType.float8e4m3fn),
    doc="act(X @ (Wf8 * w_scale) + bias + R) with X cast to float8 e4m3 after dividing by "
        "x_scale (saturating at 448); inputs X, Wf8 (float8e4m3fn [K, N]), w_scale (float32 "
        "[N]), bias (optional), R (optional). FP8 tensor cores on Hopper, emulated elsewhere")

QuantizeDequantize = kiln_op(
    "QuantizeDequantize", {"scale": Attr("float", REQUIRED), "zero": Attr("int", 0),
                           "signed": Attr("int", 0)}, same(),
    doc="DequantizeLinear(QuantizeLinear(X, scale, zero), scale, zero) in one pass (a Q/DQ "
        "pair read by ops other than INT8 layers): X's 8-bit codes (round half to even, "
        "saturated to int8 when signed, else uint8) back in float32")


def _conv_integer_scaled(ctx):
    return [tensor(DType.float32, conv_shape(ctx.shape(0), ctx.shape(1), ctx.attrs))]


ConvIntegerScaled = kiln_op(
    "ConvIntegerScaled", dict(ConvInteger.attrs), _conv_integer_scaled,
    doc="float32(ConvInteger(X, W, x_zero, w_zero) + int32(floor(B / S))) * S, the bias and "
        "rescale onnxruntime's dynamic quantizer writes around a ConvInteger, in its steps; "
        "inputs X (uint8), W, x_zero, w_zero (optional), B (float32 [M]), S (float32 scalar: "
        "x_scale * w_scale)")

DynamicConvInteger = kiln_op(
    "DynamicConvInteger", dict(ConvInteger.attrs), _conv_integer_scaled,
    doc="DynamicQuantizeLinear(X) -> ConvIntegerScaled with S = x_scale * w_scale: X's uint8 "
        "codes by its own range, float32(ConvInteger(codes, W, x_zero, w_zero) + "
        "int32(floor(B / S))) * S, in onnxruntime's steps; inputs X (float32), W (8-bit "
        "constant), w_zero (optional), B (float32 [M]), w_scale (float32 scalar)")


def _dynamic_matmul_integer(ctx):
    from kiln.ops.quant import matmul_shape

    return [tensor(DType.float32, matmul_shape(ctx.shape(0), ctx.shape(1)))]


DynamicMatMulInteger = kiln_op(
    "DynamicMatMulInteger", {}, _dynamic_matmul_integer,
    doc="DynamicQuantizeLinear(X) -> MatMulInteger(codes, W, x_zero, w_zero) -> Cast(float) -> "
        "Mul(x_scale * w_scale) (-> Add(bias)) in onnxruntime's steps: the exact int32 "
        "products of X's codes by a constant 8-bit W as float32 times the float32 product "
        "x_scale * w_scale, plus the bias; inputs X (float32), W (8-bit constant [K, N]), "
        "w_zero (optional), w_scale (float32, 1 or N values), bias (optional, float32 [N])")


def _layernorm_quant(ctx):
    x = ctx.type(0)
    codes = DType.float8e4m3fn if ctx.attrs.fp8 else DType.int8
    return [x, tensor(codes, None if x is None else x.shape)]


LayerNormQuant = kiln_op(
    "LayerNormQuant", {"axis": Attr("int", -1), "epsilon": Attr("float", 1e-5),
                       "stash_type": Attr("int", 1), "zshift": Attr("int", 0),
                       "fp8": Attr("int", 0)}, _layernorm_quant,
    doc="LayerNormalization over the last axis that also writes its output as the codes of "
        "the INT8/FP8 layers reading it: outputs Y (float) and codes ``clamp(round(Y * "
        "qmul) + zshift, -128, 127)`` (int8), or ``Y * qmul`` saturated to float8 e4m3 "
        "(fp8); inputs X, scale, bias, qmul (float32 [C]: the readers' 1 / x_scale per "
        "channel, times a smoothing multiplier where there is one)")
