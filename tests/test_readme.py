"""The README stays true: its ops table is the registry's, its test command is CI's."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_ops_table_matches_registry():
    import sys

    import pytest

    pytest.importorskip("triton", reason="the table lists the Triton kernels; install triton")

    sys.path.insert(0, str(ROOT))
    from tools.update_readme_ops import END, START, ops_markdown

    text = (ROOT / "README.md").read_text()
    table = text.split(START)[1].split(END)[0].strip()
    assert table == ops_markdown(), "run: python tools/update_readme_ops.py"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```", readme).group(1).strip()
    assert cmd in ci


def test_readme_cli_commands_exist():
    from kiln.cli.main import TOOLS

    readme = (ROOT / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", readme, flags=re.S))
    names = re.findall(r"^kiln (\w+)", blocks, flags=re.M) + re.findall(r"&& kiln (\w+)", blocks)
    assert {"build", "run", "inspect", "bench", "demo"} <= set(names)
    for name in names:
        assert name in {t.NAME for t in TOOLS}, f"README mentions `kiln {name}`"
