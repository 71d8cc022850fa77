"""Fused ops kiln's optimizer creates (conv and gemm): convolutions and matrix products with
their bias, activation and residual add folded in.

Every fused op computes ``act(op(x, W) + bias + residual)``: the residual (when
``has_residual``) is added *before* the activation, as in ResNet's ``relu(conv(x) + identity)``.
``activation`` names the epilogue ("" for none); ``alpha`` / ``beta`` are its parameters
(Clip: min / max, LeakyRelu: alpha, HardSwishAffine: ``alpha * HardSwish(y) + beta``, the
scale and shift PP-LCNetV3 writes after its activations; CPU kernels only). The activations
are listed in :data:`ACTIVATIONS`.
"""

from __future__ import annotations

from kiln.ir.opdef import Attr
from kiln.ops.nn import _conv_rule, _gemm_rule, _matmul_rule
from kiln.ops.rules import same
from kiln.ops.schema import kiln_op

# the epilogues the fused ops (and their kernels) know; "" is none
ACTIVATIONS = ("", "Relu", "Clip", "Sigmoid", "Tanh", "Silu", "Gelu", "GeluTanh", "HardSwish",
               "LeakyRelu", "HardSwishAffine")

_EPILOGUE = {
    "activation": Attr("string", ""),
    "alpha": Attr("float", 0.0),
    "beta": Attr("float", 0.0),
    "has_residual": Attr("int", 0),
}

_CONV_ATTRS = {
    "auto_pad": Attr("string", "NOTSET"),
    "dilations": Attr("ints", None),
    "group": Attr("int", 1),
    "kernel_shape": Attr("ints", None),
    "pads": Attr("ints", None),
    "strides": Attr("ints", None),
    # "nhwc": activations channels-last and weights pre-packed on first run (set by layout)
    "layout": Attr("string", ""),
}

FusedConv = kiln_op(
    "FusedConv", {**_CONV_ATTRS, **_EPILOGUE}, _conv_rule,
    doc="act(Conv(X, W, B) + R); inputs X, W, B (optional), R (optional residual)")

FusedGemm = kiln_op(
    "FusedGemm", {"transA": Attr("int", 0), "transB": Attr("int", 0), **_EPILOGUE}, _gemm_rule,
    doc="act(op(A) @ op(B) + C + R) with ONNX Gemm's transA/transB (alpha = beta = 1)")


FusedMatMul = kiln_op(
    "FusedMatMul", dict(_EPILOGUE), _matmul_rule,
    doc="act(X @ W + bias + R) for N-D X and 2-D constant W; bias (optional) on the last dim")


FusedMatMulLayerNorm = kiln_op(
    "FusedMatMulLayerNorm", {**_EPILOGUE, "epsilon": Attr("float", 1e-5)}, _matmul_rule,
    doc="LayerNormalization over the last dim of act(X @ W + bias + R); inputs X, W, B "
        "(optional), R (optional), Scale, LnBias (optional); CPU builds only")


SqueezeExcite = kiln_op(
    "SqueezeExcite", {"activation": Attr("string", ""), "gate": Attr("string", "Sigmoid"),
                      "alpha": Attr("float", 0.0), "beta": Attr("float", 0.0)}, same(0),
    doc="X * gate(Conv1x1(act(Conv1x1(mean of X over H, W, W1, B1)), W2, B2)): a squeeze-excite "
        "block; inputs X [N, C, H, W], W1 [Cr, C, 1, 1], B1, W2 [C, Cr, 1, 1], B2 (biases "
        "optional). activation: one of FusedConv's; gate: Sigmoid or HardSigmoid (alpha, "
        "beta: max(0, min(1, alpha * s + beta))).")
