"""Regenerate the supported-operators table in README.md from the op registry.

    python tools/update_readme_ops.py
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import sys

START, END = "<!-- ops-table:start -->", "<!-- ops-table:end -->"


def ops_markdown() -> str:
    from kiln.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["ops", "--markdown"])
    return buf.getvalue().strip()


def update(readme: pathlib.Path) -> bool:
    text = readme.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    new = f"{head}{START}\n{ops_markdown()}\n{END}{tail}"
    changed = new != text
    readme.write_text(new)
    return changed


if __name__ == "__main__":
    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    print("README.md updated" if update(root / "README.md") else "README.md already current")
