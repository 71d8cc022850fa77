"""kiln ops: the supported-operator table, generated from the registry."""

from __future__ import annotations

from kiln.cli.args import add_common_args

NAME = "ops"
HELP = "list the supported operators (docs/supported-ops.md comes from --markdown)"


def add_arguments(p):
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    add_common_args(p)


def op_rows() -> list[dict]:
    import kiln.kernels.torch  # registers the CPU kernels
    import kiln.ops

    try:  # the Triton (CUDA) kernels register on import, where Triton is installed
        import kiln.kernels.triton
    except ImportError:
        pass
    from kiln.kernels.registry import kernels_for

    rows = []
    for op in kiln.ops.REGISTRY:
        rows.append({"op": op.name, "domain": op.domain or "ai.onnx",
                     "versions": ", ".join(map(str, op.versions)) or "-",
                     "cpu": ", ".join(k.name for k in kernels_for(op, "cpu")) or "-",
                     "cuda": ", ".join(k.name for k in kernels_for(op, "cuda")) or "-",
                     "shape_rule": "yes" if op.infer else "onnx"})
    return rows


def main(args) -> int:
    rows = op_rows()
    if args.markdown:
        print("| op | domain | opset versions | CPU kernel | CUDA kernel | shape rule |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['op']} | {r['domain']} | {r['versions']} | {r['cpu']} | {r['cuda']} "
                  f"| {r['shape_rule']} |")
    else:
        for r in rows:
            print(f"{r['domain']:<26} {r['op']:<30} cpu: {r['cpu']:<28} cuda: {r['cuda']}")
    print(f"{len(rows)} operators" if not args.markdown else "")
    return 0
