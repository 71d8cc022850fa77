"""Calibration data: an iterable of batches, each a dict ``{input name: array}``.

:func:`load_batches` reads what the CLI's ``--calib`` names:

- a folder of ``.npz`` files: each file is one batch, its keys the input names;
- a folder of ``.npy`` files, for a model with one input: each file is one batch of it;
- one ``.npz`` file: one batch;
- a Python file defining ``batches()``, which returns or yields the batches.

Files are read in sorted name order, so calibration is repeatable.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from kiln.errors import KilnError


def load_batches(source, input_names: list[str]) -> list[dict[str, np.ndarray]]:
    """The batches ``source`` holds (see the module docstring), each checked to name exactly
    ``input_names``. An iterable of dicts is taken as it is."""
    if not isinstance(source, (str, Path)):
        batches = list(source)
    else:
        batches = _from_path(Path(source), input_names)
    if not batches:
        raise KilnError(f"calibration data {source}: no batches found")
    for k, b in enumerate(batches):
        _check(b, input_names, f"calibration batch {k}")
    return [{n: np.asarray(b[n]) for n in input_names} for b in batches]


def _from_path(p: Path, input_names: list[str]) -> list[dict]:
    if not p.exists():
        raise KilnError(f"calibration data {p}: no such file or folder")
    if p.is_file() and p.suffix == ".py":
        return _from_python(p)
    if p.is_file() and p.suffix == ".npz":
        return [_npz(p)]
    if not p.is_dir():
        raise KilnError(f"calibration data {p}: give a folder of .npz/.npy batches, one .npz "
                        "file, or a Python file defining batches()")
    npz, npy = sorted(p.glob("*.npz")), sorted(p.glob("*.npy"))
    if npz and npy:
        raise KilnError(f"calibration data {p}: holds both .npz and .npy files; keep one kind")
    if npz:
        return [_npz(f) for f in npz]
    if npy:
        if len(input_names) != 1:
            raise KilnError(f"calibration data {p}: .npy batches need a model with one input; "
                            f"this one has {len(input_names)} ({', '.join(input_names)}): "
                            "write .npz batches keyed by input name")
        return [{input_names[0]: np.load(f, allow_pickle=False)} for f in npy]
    raise KilnError(f"calibration data {p}: the folder has no .npz or .npy files")


def _npz(f: Path) -> dict:
    with np.load(f, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _from_python(p: Path) -> list[dict]:
    spec = importlib.util.spec_from_file_location(f"kiln_calib_{p.stem}", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, "batches", None)
    if not callable(fn):
        raise KilnError(f"calibration data {p}: the file must define batches(), returning or "
                        "yielding dicts {input name: array}")
    return list(fn())


def _check(b, input_names: list[str], what: str) -> None:
    if not isinstance(b, dict):
        raise KilnError(f"{what}: expected a dict {{input name: array}}, got {type(b).__name__}")
    missing = [n for n in input_names if n not in b]
    extra = [n for n in b if n not in input_names]
    if missing or extra:
        raise KilnError(f"{what}: inputs do not match the model's ({', '.join(input_names)}): "
                        + "; ".join(x for x in (
                            f"missing {', '.join(missing)}" if missing else "",
                            f"unknown {', '.join(map(str, extra))}" if extra else "") if x))
