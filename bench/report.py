"""The results table (plain text or Markdown) and the JSON file."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.peers import TOLERANCE

COLUMNS = ("workload", "batch", "system", "prec", "check", "median ms", "p90 ms", "items/s",
           "setup/compile s", "peak mem MiB", "build peak MiB", "kiln speed-up")


def header_lines(result: dict) -> list[str]:
    m, v = result["machine"], result["versions"]
    tol = ", ".join(f"{k.upper()} {t:g}" for k, t in TOLERANCE.items())
    return [
        f"kiln bench, {result['device']}, {result['date']}",
        (f"machine: {m['cpu']} ({m['cores']} cores), GPU: {m.get('gpu') or 'none'}; "
         f"load average at start {m['loadavg_start']}"),
        "versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x),
        ("kiln speed-up = peer median / kiln median (>1: kiln is faster); latency is one "
         "forward pass; items/s = batch / mean latency over the timed run"),
        (f"check: outputs vs the FP32 reference ({result['reference']}) before timing, "
         f"max|out - ref| / max|ref| within {tol}"),
        f"memory: {result['memory_method']}",
        *([f"host malloc: {result['host_malloc']}"] if result.get("host_malloc") else []),
        ("setup/compile s: kiln build + save + load + context; onnxruntime session creation; "
         "torch model construction; torch.compile construction + first call (compile)"),
    ]


def _num(x, fmt: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def _check(row: dict) -> str:
    if row["status"] != "ok" and row["status"] != "mismatch":
        reason = row["reason"]  # the whole reason is in the JSON
        return f"{row['status']}: {reason if len(reason) <= 70 else reason[:67] + '...'}"
    if row.get("reference"):
        return "reference"
    err = _num(row.get("max_rel_err"), ".1e")
    return f"ok ({err})" if row["status"] == "ok" else f"MISMATCH ({err} > {row['tolerance']:g})"


def cells(row: dict) -> list[str]:
    return [row["workload"], str(row["batch"]), row["system"], row["precision"], _check(row),
            _num(row.get("median_ms"), ".2f"), _num(row.get("p90_ms"), ".2f"),
            _num(row.get("items_per_s"), ".1f"), _num(row.get("setup_s"), ".1f"),
            _num(row.get("peak_mem_mib"), ".0f"), _num(row.get("build_peak_mem_mib"), ".0f"),
            _speedup(row)]


def _speedup(row: dict) -> str:
    if row.get("kiln"):
        return "1.00 (kiln)" if row.get("median_ms") is not None else "-"
    return _num(row.get("kiln_speedup"), ".2f")


def table(result: dict, markdown: bool = False) -> str:
    rows = [cells(r) for r in result["rows"]]
    lines = header_lines(result)
    if markdown:
        out = [f"- {x}" for x in lines[1:]]
        out = [f"**{lines[0]}**", "", *out, ""]
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "|".join("---" if i < 4 else "---:" for i in range(len(COLUMNS))) + "|")
        out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
        return "\n".join(out) + "\n"
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 5 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [*lines, "", fmt.format(*COLUMNS), "  ".join("-" * w for w in widths)]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(out) + "\n"


def add_speedups(rows: list[dict]) -> None:
    """kiln_speedup on every peer row: peer median / median of kiln (same precision family:
    "kiln" for FP32 rows, "kiln fp16" for FP16 rows) on the same workload."""
    for r in rows:
        if r.get("kiln") or r.get("median_ms") is None:
            continue
        kiln_name = "kiln fp16" if r["precision"] == "fp16" else "kiln"
        k = next((x for x in rows if x["key"] == r["key"] and x["system"] == kiln_name), None)
        if k is not None and k.get("median_ms"):
            r["kiln_speedup"] = r["median_ms"] / k["median_ms"]


def write(result: dict, path: Path) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and the Markdown table next to it (same stem, .md)."""
    result = dict(result, rows=[dict(r) for r in result["rows"]])
    add_speedups(result["rows"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)
    md = path.with_suffix(".md")
    md.write_text(table(result, markdown=True))
    return path, md
