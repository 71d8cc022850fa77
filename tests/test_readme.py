"""The README and docs/ stay true: links resolve, commands parse with the real CLI, generated
sections are what their generators give, and the README stays short."""

from __future__ import annotations

import pathlib
import re
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = CODE_BLOCK.sub("", path.read_text())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(path: pathlib.Path) -> list[str]:
    """Every relative link in the Markdown file ``path`` whose file (or #anchor) is missing."""
    bad = []
    for target in LINK.findall(CODE_BLOCK.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{path.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def kiln_commands(markdown: str) -> list[str]:
    """The ``kiln ...`` command lines inside the code blocks of ``markdown``."""
    cmds = []
    for _, block in CODE_BLOCK.findall(markdown):
        for line in block.splitlines():
            for part in re.split(r"&&|;|\|", line):
                part = part.split(" #")[0].strip()
                if part.startswith("kiln "):
                    cmds.append(part)
    return cmds


def bad_command(cmd: str) -> str | None:
    """Why the real argparse parser refuses ``cmd`` (a ``kiln ...`` line), or None."""
    import contextlib
    import io

    from kiln.cli.main import make_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            make_parser().parse_args(shlex.split(cmd)[1:])
    except SystemExit:
        return f"`{cmd}`: {err.getvalue().strip().splitlines()[-1]}"
    return None


def _subparsers():
    import argparse

    from kiln.cli.main import make_parser

    action = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


# --- the checkers can fail -------------------------------------------------------------------

def test_broken_links_finds_missing_file_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Real part\n[ok](a.md#real-part) [x](nope.md) "
                                   "[y](a.md#no-part) [web](https://example.com)\n")
    assert broken_links(tmp_path / "a.md") == [
        "a.md: nope.md (no such file)", "a.md: a.md#no-part (no heading #no-part in a.md)"]


def test_bad_command_refuses_unknown_subcommand_and_flag():
    assert bad_command("kiln bogus x") is not None
    assert "--no-such-flag" in bad_command("kiln build m.onnx --no-such-flag")
    assert bad_command("kiln build m.onnx -o m.kiln --shapes input:1x3x224x224") is None


def test_kiln_commands_reads_code_blocks_only():
    text = "kiln nope\n```bash\npip install -e . && kiln demo\nkiln run a.kiln  # once\n```\n"
    assert kiln_commands(text) == ["kiln demo", "kiln run a.kiln"]


# --- the README and docs ---------------------------------------------------------------------

def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; reference belongs in docs/"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve(path):
    assert broken_links(path) == []


def test_readme_commands_parse_with_the_real_cli():
    cmds = kiln_commands(README.read_text())
    assert {c.split()[1] for c in cmds} >= {"demo", "build", "inspect", "run", "bench"}
    assert [bad for c in cmds if (bad := bad_command(c))] == []


def test_readme_python_names_exist():
    import kiln

    code = "\n".join(b for lang, b in CODE_BLOCK.findall(README.read_text()) if lang == "python")
    names = set(re.findall(r"\bkiln\.(\w+)", code))
    assert names >= {"Builder", "BuilderConfig", "load"}
    assert sorted(n for n in names if not hasattr(kiln, n)) == []


def test_cli_doc_covers_every_subcommand_and_flag():
    docs = "\n".join(p.read_text() for p in DOCS)
    missing = []
    for name, sub in _subparsers().items():
        if f"kiln {name}" not in docs:
            missing.append(f"kiln {name}")
        for action in sub._actions:
            flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if flags and not any(f in docs for f in flags):
                missing.append(f"kiln {name} {flags[0]}")
    assert missing == [], "document these in docs/cli.md"


def test_cli_doc_flags_are_real():
    text = (ROOT / "docs" / "cli.md").read_text()
    synopsis = CODE_BLOCK.findall(text)[0][1]
    subs = _subparsers()
    wrong = []
    for entry in re.split(r"\n(?=kiln )", synopsis.strip()):
        name = entry.split()[1]
        known = {o for a in subs[name]._actions for o in a.option_strings}
        wrong += [f"kiln {name} {f}" for f in re.findall(r"--[a-z][\w-]*", entry)
                  if f not in known]
    assert wrong == []


def test_readme_test_command_is_what_ci_runs():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```", readme).group(1).strip()
    assert cmd in ci.splitlines()


def test_supported_ops_doc_matches_registry():
    pytest.importorskip("triton", reason="the table lists the Triton kernels; install triton")
    sys.path.insert(0, str(ROOT))
    from tools.update_ops_doc import DOC, render

    assert DOC.read_text() == render(), "run: python tools/update_ops_doc.py"


def test_readme_bench_tables_are_generated():
    sys.path.insert(0, str(ROOT))
    from bench import readme

    text = README.read_text()
    assert readme.render(text) == text, "run: python -m bench.readme"


def test_bench_docs_describe_every_bench_file_and_name_real_modules():
    import subprocess

    bench_doc = (ROOT / "docs" / "bench.md").read_text()
    tracked = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    tools = [f for f in tracked if "/results/" not in f
             and f not in ("bench/__init__.py", "bench/README.md")]
    assert tools, "git ls-files found no bench files"
    assert [f for f in tools if f"`{f}`" not in bench_doc] == [], "describe them in docs/bench.md"
    text = "\n".join(p.read_text() for p in [README, *DOCS])
    modules = set(re.findall(r"python -m (bench\.\w+)", text))
    def runnable(m: str) -> bool:  # a module, or a package with a __main__
        p = ROOT / m.replace(".", "/")
        return p.with_suffix(".py").exists() or (p / "__main__.py").exists()

    assert [m for m in sorted(modules) if not runnable(m)] == []
