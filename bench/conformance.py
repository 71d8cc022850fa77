"""The ONNX backend node test suite through ``kiln.onnx_backend`` on one device, in one run.

    python -m bench.conformance --device cuda [--workers 8] [--out DIR] [--only REGEX]

Every case the installed ``onnx`` package ships is built (full optimizer pipeline; on CUDA
strict FP32, TF32 off, with the autotuner's picks) and run, and its outputs are compared with
ONNX's expected ones at the case's own tolerances. Skips: tests/conformance/skips.txt (the
CPU's, one reason each) and, on CUDA, tests/conformance/skips_cuda.txt as well.

Cases run in ``--workers`` child processes (one CUDA context each). A case that kills its
child is recorded as ``crash`` and the child restarts after it; cases left when the time budget
(``--budget`` seconds) runs out are ``not run``. On CUDA a case also fails when a step's output
came back on the host from device inputs, or when a large value was computed on the host
(``Placement.moved``): no op may run silently on the host.

Writes DIR/conformance_<device>.json (every case) and .md (the pass rate and the failures,
grouped by first error line).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import tempfile
import time
import warnings

SKIP_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "conformance"


def read_skips(path: pathlib.Path) -> dict[str, str]:
    """``<case name>  # <reason>`` per line; ``#`` lines are comments."""
    out = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition("#")
            out[name.strip()] = reason.strip() or "no reason given"
    return out


def skips_for(device: str) -> dict[str, str]:
    skips = read_skips(SKIP_DIR / "skips.txt")
    if device == "cuda":
        skips.update({k: f"CUDA: {v}" for k, v in
                      read_skips(SKIP_DIR / "skips_cuda.txt").items()})
    return skips


def _cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.loader import load_model_tests
        return load_model_tests(kind="node")


# ---- one child: runs a list of cases, one JSON line per event -------------------------------

def run_case(case, device: str) -> dict:
    import numpy as np
    from onnx.backend.test.runner import Runner, _normalize_tensor

    import kiln.onnx_backend as backend

    rep = backend.prepare(case.model, device.upper())
    for inputs, refs in case.data_sets:
        outs = rep.run([_normalize_tensor(x) for x in inputs])
        with np.errstate(all="ignore"):
            Runner.assert_similar_outputs(
                [_normalize_tensor(x) for x in refs], list(outs), rtol=case.rtol, atol=case.atol)
    placement = rep.executor.placement
    if placement is not None and placement.moved:
        return {"status": "fail", "error": "host fallback: " + "; ".join(
            f"{k} ({v})" for k, v in placement.moved.items())}
    notes = {k: v for k, v in (("host", placement and placement.host),
                               ("lifted", placement and placement.lifted)) if v}
    return {"status": "pass", **notes}


def child(cases_file: str, device: str, log) -> None:
    with open(cases_file, "rb") as f:
        by_name = {c.name: c for c in pickle.load(f)}  # the parent's: loading them is slow
    for name in by_name:
        log.write(json.dumps({"case": name, "status": "start"}) + "\n")
        log.flush()
        t0 = time.perf_counter()
        try:
            res = run_case(by_name[name], device)
        except Exception as e:  # a failing case is a result, not the end of the run
            res = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:2000]}
        res.update(case=name, s=round(time.perf_counter() - t0, 3))
        log.write(json.dumps(res) + "\n")
        log.flush()
        if "device-side assert" in res.get("error", ""):
            sys.exit(3)  # the CUDA context is lost: the parent restarts after this case


# ---- the parent: shards, restarts after crashes, the budget ---------------------------------

def _read_log(path: pathlib.Path) -> tuple[dict, str | None]:
    done, started = {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r["status"] == "start":
                started = r["case"]
            else:
                done[r["case"]] = r
                started = None
    return done, started


def run_all(cases: list, device: str, workers: int, budget: float, tmp: pathlib.Path
            ) -> dict[str, dict]:
    by_name = {c.name: c for c in cases}
    names = list(by_name)
    shards = [names[k::workers] for k in range(workers)]
    results: dict[str, dict] = {}
    procs: dict[int, tuple] = {}
    deadline = time.monotonic() + budget

    def start(k: int, todo: list[str], gen: int):
        if not todo:
            return
        log = tmp / f"shard{k}_{gen}.jsonl"
        lst = tmp / f"shard{k}_{gen}.pkl"
        with open(lst, "wb") as f:
            pickle.dump([by_name[n] for n in todo], f)
        p = subprocess.Popen([sys.executable, "-m", "bench.conformance", "--device", device,
                              "--child", str(lst), "--log", str(log)],
                             stdout=subprocess.DEVNULL, stderr=open(f"{log}.err", "w"))
        procs[k] = (p, todo, log, gen)

    for k, shard in enumerate(shards):
        start(k, shard, 0)
    while procs and time.monotonic() < deadline:
        time.sleep(0.5)
        for k, (p, todo, log, gen) in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[k]
            done, started = _read_log(log)
            results.update(done)
            left = [n for n in todo if n not in done]
            if started is not None:  # the child died inside this case
                err = pathlib.Path(f"{log}.err").read_text()[-1500:]
                results[started] = {"case": started, "status": "crash",
                                    "error": f"child exited {p.returncode}: {err}"}
                left = [n for n in left if n != started]
            start(k, left, gen + 1)
    for p, todo, log, _gen in procs.values():
        p.kill()
        p.wait()
        done, started = _read_log(log)
        results.update(done)
        for n in todo:
            if n not in results:
                results[n] = {"case": n, "status": "not run",
                              "error": "time budget spent" + (" (running)" if n == started
                                                              else "")}
    return results


def summarize(results: dict, skips: dict, device: str, wall: float) -> tuple[dict, str]:
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    ran = sum(counts.values())
    rate = counts.get("pass", 0) / ran if ran else 0.0
    groups: dict[str, list[str]] = {}
    for r in results.values():
        if r["status"] != "pass":
            key = re.sub(r"\d+", "N", r.get("error", "").splitlines()[0][:140] if r.get(
                "error") else r["status"])
            groups.setdefault(key, []).append(r["case"])
    host = {r["case"]: r["host"] for r in results.values() if r.get("host")}
    summary = {"device": device, "cases": ran, "skipped": len(skips), "counts": counts,
               "declared_host_fallbacks": host,
               "pass_rate": round(rate, 4), "wall_s": round(wall, 1)}
    md = [f"# ONNX node conformance on {device}", "",
          f"{counts.get('pass', 0)} of {ran} run cases pass (**{100 * rate:.2f}%**); "
          f"{len(skips)} skipped (listed with reasons in tests/conformance/skips*.txt); "
          f"{counts} in {wall:.0f} s.", "", "| cases | first error line |", "|---|---|"]
    if host:
        md[2] += (f" {len(host)} passing cases ran a declared host fallback (named in the "
                  f"build log): {', '.join(sorted(host))}.")
    for key, cases in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(sorted(cases)[:6]) + (" ..." if len(cases) > 6 else "")
        md.append(f"| {len(cases)}: {shown} | {key.replace('|', '/')} |")
    return summary, "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default=None, help="regex: run only the cases it matches")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        with open(a.log, "a") as log:
            child(a.child, a.device, log)
        return 0
    skips = skips_for(a.device)
    cases = [c for c in _cases() if c.name not in skips
             and (a.only is None or re.search(a.only, c.name))]
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"kiln-conformance-{a.device}-"))
    t0 = time.monotonic()
    results = run_all(cases, a.device, a.workers, a.budget, tmp)
    summary, md = summarize(results, skips, a.device, time.monotonic() - t0)
    (out / f"conformance_{a.device}.json").write_text(
        json.dumps({"summary": summary, "cases": results}, indent=1))
    (out / f"conformance_{a.device}.md").write_text(md)
    print(md[:6000])
    return 0 if summary["pass_rate"] >= 0.99 else 1


if __name__ == "__main__":
    sys.exit(main())
