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

    @contextmanager
    def stage(self, what: str):
        self.k += 1
        t0 = time.perf_counter()
        if not self.quiet:
            self.stream.write(f"[{self.k}/{self.total}] {what} ...")
            self.stream.flush()
        try:
            yield
        except BaseException:
            if not self.quiet:
                self.stream.write(" failed\n")
            raise
        if not self.quiet:
            self.stream.write(f" done ({time.perf_counter() - t0:.2f} s)\n")
            self.stream.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
