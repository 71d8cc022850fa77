"""kiln inspect: what an engine (or ONNX model) holds, without running it."""

from __future__ import annotations

import json

from kiln.cli.args import add_common_args
from kiln.cli.progress import human_bytes

NAME = "inspect"
HELP = "show an engine's or ONNX model's inputs, outputs, layers, sizes and versions"


def add_arguments(p):
    p.add_argument("file", help="engine file (.kiln) or ONNX model (.onnx)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_common_args(p)


def main(args) -> int:
    info = _onnx_info(args.file) if args.file.endswith(".onnx") else _engine_info(args.file)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        _print(info)
    return 0


def _engine_info(path: str) -> dict:
    """Reads the header alone: the weights are not touched."""
    from kiln.engine.format import read_header
    from kiln.engine.profile import Profile
    from kiln.engine.serialize import decode_type

    h = read_header(path)
    profiles = [Profile.from_json(p) for p in h.get("profiles", [])]
    io = {}
    for kind in ("inputs", "outputs"):
        io[kind] = [{"name": t["name"], "type": str(decode_type(t["type"])),
                     "profiles": [p.range_str(t["name"]) for p in profiles]
                     if kind == "inputs" else []} for t in h[kind]]
    layers = [{"name": n["name"], "op": n["op"][1], "kernel": n.get("kernel", "?"),
               "tactic": n.get("tactic"), "precision": _prec(n), "output": ", ".join(
                   str(decode_type(o["type"])) for o in n["outputs"])}
              for n in h["plan"]["nodes"]]
    tb = h.get("triton_binaries") or {}
    variants = [{"kernels": v.get("kernels", {}), "tactics": v.get("tactics", {})}
                for v in h.get("profile_variants", [])]
    return {"file": path, "kind": "engine", "kiln_version": h.get("kiln_version"),
            "torch_version": h.get("torch_version"), "triton_version": h.get("triton_version"),
            "device": h.get("device"), "build": h.get("build"), **io, "layers": layers,
            "weight_bytes": h.get("weight_bytes"),
            "triton_binaries": len(tb.get("kernels", [])),
            "profile_variants": variants}


def _prec(n) -> str:
    t = n["outputs"][0]["type"] if n["outputs"] else None
    dt = (t or {}).get("dtype") or "-"
    return dt if dt.startswith(("float", "bfloat")) else "-"


def _onnx_info(path: str) -> dict:
    from kiln.frontend import import_onnx

    g = import_onnx(path)
    layers = [{"name": n.name, "op": n.op.name, "kernel": "-", "precision": "-",
               "output": ", ".join(str(v.type) for v in n.outputs)} for n in g.nodes]
    return {"file": path, "kind": "onnx", "opset": g.opset, "producer": g.metadata.get(
        "producer"), "inputs": [{"name": v.name, "type": str(v.type), "profiles": []}
                                for v in g.inputs],
            "outputs": [{"name": v.name, "type": str(v.type)} for v in g.outputs],
            "layers": layers, "op_counts": g.op_counts(),
            "weight_bytes": int(sum(w.const.nbytes for w in g.weights.values()))}


def _print(info: dict) -> None:
    print(f"{info['kind']}: {info['file']}")
    if info["kind"] == "engine":
        print(f"  built by kiln {info['kiln_version']} with torch {info['torch_version']}"
              f" (triton {info['triton_version']}) for {info['device']['kind']} "
              f"({info['device']['name']})")
    print(f"  weights: {human_bytes(info['weight_bytes'] or 0)}, layers: {len(info['layers'])}")
    if info.get("triton_binaries"):
        print(f"  embedded Triton kernels: {info['triton_binaries']} (loaded through the CUDA "
              "driver: no compiler at load)")
    for k, v in enumerate(info.get("profile_variants") or [], start=1):
        print(f"  profile {k}: tuned apart from profile 0 on {len(v['kernels'])} kernel and "
              f"{len(v['tactics'])} tactic choice(s)")
    for t in info["inputs"]:
        ranges = "; ".join(t["profiles"]) if t["profiles"] else ""
        print(f"  input  {t['name']:<24} {t['type']}" + (f"  profile: {ranges}" if ranges else ""))
    for t in info["outputs"]:
        print(f"  output {t['name']:<24} {t['type']}")
    w = max([len(r["name"]) for r in info["layers"]] + [4])
    print(f"\n  {'name':<{w}}  {'op':<22} {'precision':<9} {'kernel':<24} output")
    for r in info["layers"]:
        print(f"  {r['name']:<{w}}  {r['op']:<22} {r['precision']:<9} {r['kernel']:<24} "
              f"{r['output']}")
