"""Engine load time against onnxruntime session creation, for one zoo model.

    python -m bench.load_time [--model resnet50] [--repeats 5]

kiln: ``kiln.load(engine)`` (header, checksum over the whole file, memory-mapped weights, plan)
and then the first inference. onnxruntime: ``InferenceSession(model.onnx)`` with default
optimizations, then its first inference. Both in this process, alternating, median of repeats;
imports and interpreter start-up are excluded for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    import onnxruntime as ort

    import kiln
    from kiln import zoo

    onnx_path = zoo.build_onnx(args.model)
    feeds = zoo.sample_inputs(args.model, batch=1)
    engine_path = os.path.join(tempfile.mkdtemp(prefix="kiln-load-"), f"{args.model}.kiln")
    kiln.Builder().build(onnx_path).save(engine_path)
    rows = {"kiln_load_ms": [], "kiln_load_first_run_ms": [], "ort_session_ms": [],
            "ort_session_first_run_ms": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine = kiln.load(engine_path)
        t1 = time.perf_counter()
        engine.create_context().run(feeds)
        t2 = time.perf_counter()
        rows["kiln_load_ms"].append(1e3 * (t1 - t0))
        rows["kiln_load_first_run_ms"].append(1e3 * (t2 - t0))
        del engine
        t0 = time.perf_counter()
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        t1 = time.perf_counter()
        sess.run(None, feeds)
        t2 = time.perf_counter()
        rows["ort_session_ms"].append(1e3 * (t1 - t0))
        rows["ort_session_first_run_ms"].append(1e3 * (t2 - t0))
        del sess
    out = {k: round(statistics.median(v), 1) for k, v in rows.items()}
    out.update(model=args.model, repeats=args.repeats, engine_bytes=os.path.getsize(engine_path),
               loadavg=open("/proc/loadavg").read().split()[:3])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
