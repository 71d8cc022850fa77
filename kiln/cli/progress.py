"""A small stage display on stderr: ``[2/4] optimizing ... done (0.31 s)``."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Stages:
    def __init__(self, total: int, stream=None, quiet: bool = False):
        self.total, self.k = total, 0
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self._open = self._broken = False

    def line(self, msg: str, stream=None) -> None:
        """Print ``msg`` on a line of its own, also while a stage's ``...`` line is open
        (the stage then ends on a line that names it again)."""
        if self._open and not self._broken and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
            self._broken = True
        print(msg, file=stream or sys.stdout, flush=True)

    @contextmanager
    def stage(self, what: str):
        self.k += 1
        t0 = time.perf_counter()
        if not self.quiet:
            self.stream.write(f"[{self.k}/{self.total}] {what} ...")
            self.stream.flush()
        self._open, self._broken = True, False
        try:
            yield
        except BaseException:
            if not self.quiet:
                self.stream.write(self._again(what) + " failed\n")
            raise
        finally:
            self._open = False
        if not self.quiet:
            self.stream.write(self._again(what) + f" done ({time.perf_counter() - t0:.2f} s)\n")
            self.stream.flush()

    def _again(self, what: str) -> str:
        return f"[{self.k}/{self.total}] {what} ..." if self._broken else ""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
