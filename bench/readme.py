"""python -m bench.readme: README.md's benchmark sections, generated from bench/results/.

    python -m bench.readme            # rewrite the sections in README.md
    python -m bench.readme --check    # exit 1 (and say which) if README.md is out of date

Per device (CPU, CUDA) the README shows the newest run in ``bench/results/`` that covers every
default model (``bench.workloads.DEFAULT_MODELS``), as one compact table: kiln's median latency
per workload and each peer's median with kiln's speed-up over it, under that run's command,
date, machine and versions, and a link to the run's full table. A run that stopped early says
so. The corpus section is the newest whole-corpus ``bench/results/corpus-cpu-*.md`` (the most
models, then the latest run), as the corpus bench wrote it. Each section sits between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

from bench.workloads import DEFAULT_MODELS, LABELS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEVICES = {"cpu": "bench-cpu", "cuda": "bench-cuda"}
CORPUS = "corpus-table"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with what lies between NAME's start and end markers replaced by ``body``."""
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"README needs exactly one '{start}' followed by one '{end}' "
                         f"(the generated section {name!r} goes between them)")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


def section(text: str, name: str) -> str:
    start, end = markers(name)
    return text.split(start)[1].split(end)[0].strip()


def _runs(results: Path, device: str):
    for path in sorted(results.glob(f"{device}-*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("device") == device and data.get("rows"):
            yield path, data


def _covers_defaults(result: dict) -> bool:
    names = {r["workload"] for r in result["rows"]}
    return all(any(n.startswith(LABELS[m]) for n in names) for m in DEFAULT_MODELS)


def newest_run(device: str, results: Path = RESULTS) -> tuple[Path, dict] | None:
    """The newest (by its ``date``) bench.run result for ``device`` covering every default
    model, or None."""
    runs = [(dt.datetime.fromisoformat(d["date"]), p, d) for p, d in _runs(results, device)
            if _covers_defaults(d)]
    if not runs:
        return None
    _, path, data = max(runs, key=lambda x: x[0])
    return path, data


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("median_ms") is None:
        return row["status"]
    cell = f"{row['median_ms']:.2f}"
    if row["status"] == "mismatch":
        cell += "*"
    if row.get("kiln_speedup") is not None:
        cell += f" ({row['kiln_speedup']:.2f}x)"
    return cell


def compact_table(result: dict) -> list[str]:
    """One line per workload and batch, one column per system that has a time somewhere."""
    rows = result["rows"]
    keys = list(dict.fromkeys((r["workload"], r["batch"]) for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    timed = [s for s in systems if any(r["system"] == s and r.get("median_ms") for r in rows)]
    kiln = [s for s in timed if any(r["system"] == s and r.get("kiln") for r in rows)]
    order = kiln + [s for s in timed if s not in kiln]
    by_key = {(r["workload"], r["batch"], r["system"]): r for r in rows}
    out = ["| workload | batch | " + " | ".join(f"{s} ms" for s in order) + " |",
           "|---|---:|" + "---:|" * len(order)]
    for wl, batch in keys:
        cells = [_cell(by_key.get((wl, batch, s))) for s in order]
        out.append(f"| {wl} | {batch} | " + " | ".join(cells) + " |")
    return out


def _notes(result: dict) -> list[str]:
    rows = result["rows"]
    out = []
    bad = [r for r in rows if r["status"] == "mismatch"]
    if bad:
        errs = ", ".join(f"{r['workload']} b{r['batch']} {r['system']} {r['max_rel_err']:.1e}"
                         for r in bad)
        out.append(f"- \\* outside its tolerance against the FP32 reference (max relative error, "
                   f"tolerance FP32 {result['tolerance']['fp32']:g}, FP16 "
                   f"{result['tolerance']['fp16']:g}): {errs}.")
    for s in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == s]
        if not any(r.get("median_ms") for r in mine):
            out.append(f"- not in the table: {s} ({mine[0]['status']}: {mine[0]['reason']}).")
    if not result.get("complete", True):
        last = rows[-1]
        out.append(f"- this run stopped before it finished: its last row is {last['workload']} "
                   f"b{last['batch']} {last['system']}.")
    return out


def device_section(device: str, results: Path = RESULTS, base: Path = ROOT) -> str:
    found = newest_run(device, results)
    if found is None:
        return (f"No full {device.upper()} run in `bench/results/` yet: "
                f"`python -m bench.run --device {device} --markdown --readme` makes one.")
    path, result = found
    m, v = result["machine"], result["versions"]
    md = os.path.relpath(path.with_suffix(".md"), base)
    lines = [
        f"Newest full run, {result['date']} ([every column]({md}): p90, items/s, set-up "
        "time, peak memory):",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {m['cpu']} ({m['cores']} cores), GPU: {m.get('gpu') or 'none'}; "
        f"load average at start {m['loadavg_start']}",
        "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x),
        "- cells: median latency of one forward pass in ms; (Nx) = that system's median / "
        "kiln's, > 1: kiln is faster",
        "",
        *compact_table(result),
    ]
    notes = _notes(result)
    return "\n".join(lines + ([""] + notes if notes else []))


def _corpus_rank(path: Path) -> tuple:
    """Whole-corpus runs before subsets (a run of three models is a side experiment), then runs
    that started on a quiet machine (1-minute load average under half its cores: on a loaded
    one the two runtimes' thread pools suffer unequally and ratios swing both ways), then the
    newest by the run's own timestamp (file names sort ``-tag`` before ``.md``)."""
    text = path.read_text()
    models = re.search(r"^- models: (\d+)", text, re.M)
    stamp = re.search(r"\((\d{4}-\d\d-\d\dT[\d:]+)", text)
    load = re.search(r"(\d+) cores?, load average ([\d.]+)", text)
    quiet = load is None or float(load.group(2)) < int(load.group(1)) / 2
    return (int(models.group(1)) if models else 0, quiet, stamp.group(1) if stamp else "",
            path.name)


def corpus_section(results: Path = RESULTS, base: Path = ROOT) -> str:
    runs = sorted(results.glob("corpus-cpu-*.md"))
    if not runs:
        return ("No corpus run in `bench/results/` yet: the corpus bench (issue 16) writes "
                "`bench/results/corpus-cpu-<date>.md`, and `python -m bench.readme` shows the "
                "newest here.")
    newest = max(runs, key=_corpus_rank)
    link = f"[`{newest.name}`]({os.path.relpath(newest, base)})"
    return f"From {link}:\n\n{newest.read_text().strip()}"


def render(text: str, results: Path = RESULTS, base: Path = ROOT) -> str:
    """``text`` (a README in folder ``base``) with every generated section rewritten."""
    for device, name in DEVICES.items():
        text = replace_section(text, name, device_section(device, results, base))
    return replace_section(text, CORPUS, corpus_section(results, base))


def update(readme: Path = ROOT / "README.md", results: Path = RESULTS) -> bool:
    """Rewrite the generated sections of ``readme``; True if anything changed."""
    text = readme.read_text()
    new = render(text, results, readme.resolve().parent)
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the README is not what the results give")
    args = p.parse_args(argv)
    if args.check:
        text = args.readme.read_text()
        stale = render(text, args.results, args.readme.resolve().parent) != text
        if stale:
            print(f"{args.readme} is out of date: run python -m bench.readme", file=sys.stderr)
        return int(stale)
    changed = update(args.readme, args.results)
    print(f"{args.readme}: " + ("updated" if changed else "already current"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
