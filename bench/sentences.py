"""Real English sentences from installed text: the docstrings of Python's standard library.

No download and no hand-picked list: sentences are cut from the docstrings of a fixed list of
stdlib modules (their functions and classes), kept when they read as prose (6 to 40 words,
starting with a capital, ending in a full stop, few symbols), deduplicated, in a fixed order.
The split into calibration and held-out sets is by position, so the two never overlap.
"""

from __future__ import annotations

import importlib
import inspect
import re

MODULES = ("argparse", "asyncio", "collections", "csv", "datetime", "decimal", "difflib",
           "email", "fractions", "functools", "gettext", "heapq", "http.client", "imaplib",
           "inspect", "io", "ipaddress", "json", "logging", "mailbox", "pathlib", "pickle",
           "pydoc", "queue", "random", "shutil", "smtplib", "socket", "sqlite3", "statistics",
           "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tkinter",
           "turtle", "typing", "unittest", "urllib.request", "uuid", "wave", "xml.dom.minidom",
           "zipfile")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PROSE = re.compile(r"^[A-Z][A-Za-z ,;'\-()]+\.$")


def _docstrings(mod) -> list[str]:
    out = [inspect.getdoc(mod) or ""]
    for _, obj in sorted(vars(mod).items()):
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and \
                getattr(obj, "__module__", "") == mod.__name__:
            out.append(inspect.getdoc(obj) or "")
    return out


def sentences(limit: int | None = None) -> list[str]:
    """Prose sentences from the stdlib's docstrings, deduplicated, in a fixed order."""
    seen, out = set(), []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a stdlib module this Python was built without (tkinter)
            continue
        for doc in _docstrings(mod):
            text = " ".join(doc.split())
            for s in _SPLIT.split(text):
                words = s.split()
                if 6 <= len(words) <= 40 and _PROSE.match(s) and s not in seen:
                    seen.add(s)
                    out.append(s)
    return out[:limit] if limit else out


def split(n_calib: int = 96, n_eval: int = 256) -> tuple[list[str], list[str]]:
    """(calibration, held-out) sentences: every third sentence is calibration data until
    ``n_calib`` are taken, the rest held out (first ``n_eval``)."""
    all_ = sentences()
    calib = all_[::3][:n_calib]
    chosen = set(calib)
    held = [s for s in all_ if s not in chosen][:n_eval]
    if len(calib) < n_calib or len(held) < n_eval:
        raise RuntimeError(f"only {len(all_)} sentences found; need {n_calib + n_eval}")
    return calib, held
