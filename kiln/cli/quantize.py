"""kiln quantize: calibrate an ONNX model and write it back with QuantizeLinear/DequantizeLinear
nodes (explicit quantization) that onnxruntime runs and ``kiln build`` turns into INT8 layers."""

from __future__ import annotations

from kiln.cli.args import add_calibration_args, add_common_args

NAME = "quantize"
HELP = "calibrate a model and write a QDQ (explicitly quantized) ONNX model"


def add_arguments(p):
    p.add_argument("model", help="the ONNX model")
    p.add_argument("-o", "--output", help="QDQ model to write (default: MODEL.qdq.onnx)")
    add_calibration_args(p)
    add_common_args(p)


def main(args) -> int:
    import onnx

    from kiln.builder.calibration import int8_ranges
    from kiln.builder.config import BuilderConfig
    from kiln.frontend import import_onnx
    from kiln.passes.pipeline import optimize
    from kiln.passes.quantize.qdq import write_qdq

    log = print if args.verbose else (lambda m: None)
    cfg = BuilderConfig(int8=True, calib=args.calib, calibrator=args.calibrator,
                        calib_cache=args.calib_cache, int8_asymmetric=args.asymmetric,
                        int8_smoothing=args.smooth)
    graph = optimize(import_onnx(args.model), log=log)
    scales, smooth = int8_ranges(graph, cfg, log)
    model = onnx.load(args.model)
    qdq, layers = write_qdq(model, scales, log, smooth)
    out = args.output or (args.model.rsplit(".", 1)[0] + ".qdq.onnx")
    onnx.save(qdq, out)
    print(f"wrote {out}: {layers} layer(s) quantized with {cfg.calibrator} scales")
    return 0
