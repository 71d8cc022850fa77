"""The corpus results as a Markdown table, plus the summary against issue 16's targets."""

from __future__ import annotations

import math

NEAR_MISS_NOTE = ("near misses: fusions that almost matched (the builder's "
                  "`report['near_misses']`; '-' where this builder does not record them)")


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _correct(r: dict) -> str:
    if r.get("correct") is None:
        return "-"
    err = f"{r['max_rel_err']:.1e}"
    later = r.get("steady_max_rel_err")
    if later is not None and later > r["max_rel_err"]:  # a later (planned) run's, if larger
        err += f", later runs {later:.1e}"
    sp = r.get("ref_spread")
    if not (isinstance(sp, dict) and sp):
        sp = r.get("steady_ref_spread")
    if isinstance(sp, dict) and sp:  # judged against onnxruntime's own spread
        return (f"{'yes' if r['correct'] else 'NO'} ({err}; onnxruntime's "
                f"own spread {max(sp.values()):.1e})")
    return f"{'yes' if r['correct'] else 'NO'} ({err})"


def _first(r: dict) -> str:
    if r.get("kiln_first_run_ms") is None:
        return "-"
    ratio = r.get("first_run_ratio")
    return f"{r['kiln_first_run_ms']:.0f}" + (f" ({ratio:.1f}x)" if ratio is not None else "")


def row_cells(r: dict) -> list[str]:
    layers = (f"{r['nodes_in']} → {r['layers_out']}" if r.get("layers_out") is not None
              else _f(r.get("nodes_in"), "d"))
    return [r["model"], r["family"], f"{r['exporter']} {_f(r.get('opset'), 'd', '')}".strip(),
            _correct(r), layers, _f(r.get("near_misses"), "d"), _f(r.get("kiln_ms"), ".2f"),
            _f(r.get("ort_ms"), ".2f"), _f(r.get("ratio"), ".2f"), _f(r.get("build_s"), ".1f"),
            _first(r), _f(r.get("ort_first_run_ms"), ".0f"),
            r["status"] + (f": {r['error']}" if r.get("error") else "")]


HEADER = ["model", "family", "exporter opset", "correct (max rel err)", "nodes → layers",
          "near misses", "kiln ms", "ort ms", "kiln/ort", "build s",
          "kiln first run ms (x median)", "ort first run ms", "status"]


def summary(rows: list[dict]) -> list[str]:
    ratios = [r["ratio"] for r in rows if r.get("ratio")]
    n = len(rows)
    built = sum(r.get("layers_out") is not None for r in rows)
    correct = sum(bool(r.get("correct")) for r in rows)
    lines = [f"- models: {n}; kiln builds {built}; matches onnxruntime (≤ 1e-4, or within "
             f"onnxruntime's own spread) {correct}"]
    if ratios:
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        lines.append(f"- kiln/onnxruntime at batch 1 over {len(ratios)} timed models: "
                     f"≤ 1.0x {sum(x <= 1.0 for x in ratios)}, ≤ 1.3x "
                     f"{sum(x <= 1.3 for x in ratios)}, geometric mean {geo:.2f}x, "
                     f"worst {max(ratios):.2f}x")
    first = [r for r in rows if r.get("kiln_first_run_ms") and r.get("kiln_ms")]
    ok_first = sum(r["kiln_first_run_ms"] <= 2 * r["kiln_ms"] + 50 for r in first)
    lines.append(f"- load + first run ≤ 2 x median + 50 ms: {ok_first} of {len(first)}")
    builds = [r["build_s"] for r in rows if r.get("build_s") is not None]
    if builds:
        lines.append(f"- build ≤ 15 s: {sum(b <= 15 for b in builds)} of {len(builds)} "
                     f"(slowest {max(builds):.1f} s)")
    return lines


def markdown(result: dict) -> str:
    rows = result["rows"]
    # no heading: bench.readme puts this file under a README section of its own
    out = [f"**kiln corpus on {result['device']}** ({result['date']}"
           f"{'' if result.get('complete', True) else ', incomplete run'})", "",
           f"`{result['command']}` — {result['machine']}; {result.get('threads')} threads "
           f"each; OMP_WAIT_POLICY {result.get('omp_wait_policy', 'unset')}", "",
           *summary(rows), "", "| " + " | ".join(HEADER) + " |",
           "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row_cells(r)) + " |" for r in rows]
    out += ["", NEAR_MISS_NOTE, "", result.get("notes", "")]
    cuda = [r for r in rows if r.get("cuda")]
    if cuda:
        out += ["", *cuda_tables(cuda)]
    return "\n".join(out) + "\n"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def cuda_tables(rows: list[dict]) -> list[str]:
    """Every CUDA system's timings, then kiln FP16 against torch.compile per model and batch."""
    out = ["## CUDA systems", "",
           "| model | system | per call ms | back-to-back ms | peak MiB | fp16 max rel err "
           "| build s (warm cache) | fresh-process load + first run ms |",
           "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        for k, v in r["cuda"].items():
            if "error" in v:
                out.append(f"| {r['model']} | {k} | failed: {v['error']} | | | | | |")
                continue
            if "per_call_ms" not in v:  # stopped before its timing (a build in progress)
                tail = (v.get("build_log_tail") or v.get("build_log") or ["-"])[-1]
                out.append(f"| {r['model']} | {k} | not timed (stopped; last build line: "
                           f"{tail.replace('|', '/')[:160]}) | | | | | |")
                continue
            build = (f"{v['build_s']:.1f}" if "build_s" in v else "-") + (
                f" ({v['warm_build_s']:.1f})" if "warm_build_s" in v else "")
            cold = (f"{v['load_first_run_ms']:.0f} (load {v['load_ms']:.0f})"
                    if "load_first_run_ms" in v else v.get("cold_start_error", "-"))
            out.append(f"| {r['model']} | {k} | {_ms(v['per_call_ms'])} | "
                       f"{_ms(v['back_to_back_ms'])} | {_f(v.get('peak_mem_mib'), '.0f')} | "
                       f"{_f(v.get('max_rel_err'), '.1e')} | {build} | {cold} |")
        for k, v in r["cuda"].items():
            peer = r["cuda"].get(k.replace("kiln fp16", "torch.compile reduce-overhead fp16"))
            if not k.startswith("kiln fp16") or not peer or "error" in v or "error" in peer \
                    or "per_call_ms" not in v or "per_call_ms" not in peer:
                continue
            ratios.append((r["model"], k.rsplit(" ", 1)[1],
                           peer["per_call_ms"] / v["per_call_ms"],
                           peer["back_to_back_ms"] / v["back_to_back_ms"]))
    if ratios:
        import math

        out += ["", "kiln FP16 speed-up over torch.compile(mode=\"reduce-overhead\") FP16 "
                "(>1: kiln is faster)", "",
                "| model | batch | per call | back-to-back |", "|---|---|---|---|"]
        out += [f"| {m} | {b} | {a:.2f}x | {c:.2f}x |" for m, b, a, c in ratios]
        every = [x for _, _, a, c in ratios for x in (a, c)]
        gm = math.exp(sum(math.log(x) for x in every) / len(every))
        out += ["", f"- geometric mean over {len(every)} figures: {gm:.2f}x; at or above 1.0x: "
                f"{sum(x >= 1.0 for x in every)} of {len(every)}"]
    return out
