"""kiln compare: an engine against a reference runner, output by output (and layer by layer);
exit status 0 when every output passes, 1 otherwise."""

from __future__ import annotations

from kiln.cli.args import add_common_args

NAME = "compare"
HELP = "compare an engine's outputs with a reference (onnxruntime, ONNX reference, kiln FP32)"


def add_arguments(p):
    p.add_argument("model", help="the ONNX model the engine was built from")
    p.add_argument("--engine", required=True, help="the engine file to check")
    p.add_argument("--ref", choices=["onnxruntime", "reference", "kiln-fp32"],
                   default="onnxruntime", help="reference runner (default onnxruntime)")
    p.add_argument("--inputs", metavar="DIR",
                   help="input batches (.npz / .npy folder or a Python file, as --calib); "
                        "default: one batch of random inputs")
    p.add_argument("--atol", help="absolute tolerance, one value or out:val,... (default 1e-5)")
    p.add_argument("--rtol", help="relative tolerance, one value or out:val,... (default 1e-3)")
    p.add_argument("--layerwise", action="store_true",
                   help="also compare every intermediate tensor that survives fusion and name "
                        "the first layer where the error jumps")
    p.add_argument("--cos-jump", type=float, default=0.999,
                   help="--layerwise: a layer whose cosine falls below this is where the error "
                        "jumps (default 0.999)")
    add_common_args(p)


def main(args) -> int:
    from kiln.compare import KilnRunner, compare_layers, compare_outputs, make_runner
    from kiln.engine.engine import load
    from kiln.engine.inputs import random_inputs
    from kiln.passes.quantize.data import load_batches

    engine = load(args.engine)
    runner = KilnRunner(engine)
    ref = make_runner(args.ref, args.model)
    names = [i.name for i in engine.inputs]
    batches = load_batches(args.inputs, names) if args.inputs else [
        random_inputs(engine.inputs, {}, engine.profiles[0] if engine.profiles else None)]
    rows = compare_outputs(runner, ref, batches, args.atol, args.rtol)
    print(f"{args.engine} against {ref.name} on {len(batches)} batch(es):")
    for m in rows:
        print("  " + m.line())
    if args.layerwise:
        layers, first = compare_layers(runner, ref, batches[0], args.cos_jump)
        print(f"layer by layer ({len(layers)} tensors both show):")
        for layer, m in layers:
            print(f"  {m.cosine:.6f}  max abs {m.max_abs:.3g}  {layer}")
        print(f"first layer below cosine {args.cos_jump}: {first}" if first else
              f"every layer stays above cosine {args.cos_jump}")
    ok = bool(rows) and all(m.passed for m in rows)
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1
