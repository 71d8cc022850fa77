"""Corpus files made from other corpus files: onnxruntime's quantizer on transformer and CNN
exports, in both of its formats (dynamic: MatMulInteger + DynamicQuantizeLinear; static QDQ:
QuantizeLinear/DequantizeLinear pairs from calibration; static QOperator: QLinearMatMul,
QLinearConv, QLinearAdd and the other QLinear* ops)."""

from __future__ import annotations

from pathlib import Path

from bench.corpus import manifest
from bench.corpus.spec import Spec, Unavailable, image

QUANT = ("onnxruntime.quantization",)


def _source(corpus: Path, name: str) -> tuple[Path, manifest.Entry]:
    try:
        entry = manifest.load(corpus)[name]
    except (FileNotFoundError, KeyError):
        raise Unavailable(f"needs {name} in the corpus first") from None
    return corpus / entry.file, entry


def _dynamic(src: str):
    def derive(corpus: Path, out: Path) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        path, _ = _source(corpus, src)
        quantize_dynamic(str(path), str(out), weight_type=QuantType.QInt8)
    return derive


def _static(src: str, fmt: str = "QDQ"):
    def derive(corpus: Path, out: Path) -> None:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        path, entry = _source(corpus, src)

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.batches = iter([entry.feeds(seed=s) for s in range(8)])

            def get_next(self):
                return next(self.batches, None)

        quantize_static(str(path), str(out), Reader(), quant_format=getattr(QuantFormat, fmt),
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=["MatMul", "Gemm", "Conv"])
    return derive


def specs() -> list[Spec]:
    from bench.corpus.text import _bert_inputs, _ids_mask

    return [
        Spec("hf_bert_qdynamic", "quantized", "onnxruntime quantize_dynamic (QInt8) of "
             "hf_bert_sdpa_op17", "onnxruntime.quantization", _bert_inputs(),
             derive=_dynamic("hf_bert_sdpa_op17"), requires=QUANT),
        Spec("hf_distilbert_qstatic_qdq", "quantized", "onnxruntime quantize_static (QDQ, "
             "QInt8, 8 calibration batches) of hf_distilbert_op13", "onnxruntime.quantization",
             _ids_mask(), derive=_static("hf_distilbert_op13"), requires=QUANT),
        Spec("hf_distilbert_qstatic_qop", "quantized", "onnxruntime quantize_static (QOperator, "
             "QInt8, 8 calibration batches) of hf_distilbert_op13", "onnxruntime.quantization",
             _ids_mask(), derive=_static("hf_distilbert_op13", "QOperator"), requires=QUANT),
        Spec("tv_resnet18_qstatic_qop", "quantized", "onnxruntime quantize_static (QOperator, "
             "QInt8, 8 calibration batches) of tv_resnet18_dynamo_op18", "onnxruntime.quantization",
             [image("x")], derive=_static("tv_resnet18_dynamo_op18", "QOperator"),
             requires=QUANT),
        Spec("tv_mobilenet_v3_small_qstatic_qdq", "quantized", "onnxruntime quantize_static (QDQ, "
             "QInt8, 8 calibration batches) of tv_mobilenet_v3_small_op13",
             "onnxruntime.quantization", [image("x")],
             derive=_static("tv_mobilenet_v3_small_op13"), requires=QUANT),
    ]
