"""kiln debug precision: find the layers that must stay in higher precision for an INT8 engine
to meet an accuracy target, and print the --layer-precision argument that keeps them."""

from __future__ import annotations

from kiln.cli.args import add_calibration_args, add_common_args

NAME = "debug"
HELP = "debugging tools: 'debug precision' bisects which layers must stay in FP32"


def add_arguments(p):
    p.add_argument("what", choices=["precision"], help="what to debug")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("--metric", default="cos>=0.999",
                   help="target of the INT8 outputs against FP32: cos>=X (mean per-sample "
                        "cosine), max_abs<=X or mean_abs<=X (default cos>=0.999)")
    p.add_argument("--inputs", metavar="DIR",
                   help="evaluation batches (default: the calibration batches)")
    add_calibration_args(p)
    add_common_args(p)


def main(args) -> int:
    from kiln.compare.precision_search import search
    from kiln.errors import KilnError
    from kiln.passes.quantize.data import load_batches

    if not args.calib:
        raise KilnError("kiln debug precision needs --calib DIR (calibration data)")
    evals = None
    if args.inputs:
        import onnx

        names = [i.name for i in onnx.load(args.model, load_external_data=False).graph.input]
        evals = load_batches(args.inputs, names)
    keep, value = search(args.model, args.calib, args.metric, evals, args.calibrator,
                         args.asymmetric, log=print, smoothing=args.smooth)
    if not keep:
        print(f"every layer can run in INT8 ({args.metric.split('>')[0].split('<')[0]} = "
              f"{value:.6f})")
        return 0
    arg = ",".join(f"{k}:fp32" for k in keep)
    print(f"{len(keep)} layer(s) kept in FP32 meet {args.metric} (score {value:.6f}):")
    print(f"--layer-precision '{arg}'")
    return 0
