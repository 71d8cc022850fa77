"""Fails when a test file under tests/ is not collected by ``python -m pytest``.

pytest skips folders by name (``build``, ``dist``, ``venv``, dot-folders, ...: its
``norecursedirs``), so a test folder with such a name silently never runs. CI runs this after the
tests: ``python tools/check_collection.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collected_files() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode not in (0, 5):
        sys.exit(f"pytest --collect-only failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}


def main() -> int:
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(on_disk - collected_files())
    if missing:
        print("test files pytest does not collect (rename their folder, or fix the import "
              "error pytest reports for them):", *missing, sep="\n  ")
        return 1
    print(f"all {len(on_disk)} test files under tests/ are collected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
