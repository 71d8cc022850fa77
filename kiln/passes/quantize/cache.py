"""Calibration cache in TensorRT's text format.

::

    TRT-8601-EntropyCalibration2
    input_ids: 3c010a14
    /encoder/layer.0/output/LayerNorm_output_0: 3d9e4f21

The first line names the calibrator; each further line is a tensor name and the big-endian hex
of its float32 scale (``amax / 127``). Asymmetric calibration (kiln's extension, which TensorRT
does not read) appends ``Asymmetric`` to the calibrator's name and the uint8 zero point to each
line (``name: 3c010a14 57``). Smoothing (kiln's extension, :mod:`kiln.passes.quantize.smooth`)
appends ``Smoothed`` and one line per smoothed activation, ``smooth <name>: <hex of the
float32 multipliers>``, whose scale lines are those of the smoothed tensor. TensorRT writes
its own version number after ``TRT-``; kiln writes ``8601`` there for tools that parse it
and ignores it when reading. A cache is
refused when its calibrator is not the one asked for, or when its tensors are not the ones the
model needs (a cache of another model, or of an older version of this one).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from kiln.errors import KilnError

VERSION = "8601"


def encode_scale(scale: float) -> str:
    return struct.pack(">f", float(scale)).hex()


def decode_scale(text: str) -> float:
    try:
        return struct.unpack(">f", bytes.fromhex(text.strip()))[0]
    except ValueError:
        raise ValueError(f"'{text.strip()}' is not the hex of a float32") from None


SMOOTH = "smooth "  # the prefix of a smoothing line


def write_cache(path, algorithm: str, scales: dict[str, tuple[float, int]],
                asymmetric: bool = False, smooth: dict | None = None) -> None:
    """Write ``scales`` (tensor name -> (float32 scale, uint8 zero point)) for ``algorithm``
    to ``path`` atomically (a temporary file renamed over it); ``smooth`` (name -> float32
    multipliers; None: not smoothed) after them."""
    import numpy as np

    lines = [f"TRT-{VERSION}-{algorithm}{'Asymmetric' if asymmetric else ''}"
             f"{'Smoothed' if smooth is not None else ''}"]
    for name in sorted(scales):
        if "\n" in name:
            raise ValueError(f"tensor name {name!r} cannot be written in a calibration cache")
        s, z = scales[name]
        lines.append(f"{name}: {encode_scale(s)}" + (f" {z}" if asymmetric else ""))
    for name in sorted(smooth or {}):
        m = np.asarray(smooth[name], ">f4")
        lines.append(f"{SMOOTH}{name}: {m.tobytes().hex()}")
    tmp = Path(f"{path}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def read_cache(path) -> tuple[str, dict[str, tuple[float, int]]]:
    """``(algorithm, {tensor: (scale, uint8 zero)})`` from a cache file (zero 128 where the
    line has none: symmetric). Raises :class:`KilnError` for a file that
    is not a calibration cache, naming the line at fault."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"calibration cache {path}: cannot read it ({e})") from None
    lines = text.splitlines()
    head = lines[0].strip() if lines else ""
    parts = head.split("-", 2)
    if len(parts) != 3 or parts[0] != "TRT" or not parts[2]:
        raise KilnError(f"calibration cache {path}: the first line should read "
                        f"'TRT-<version>-<calibrator>', not {head[:80]!r}")
    scales: dict[str, tuple[float, int]] = {}
    for k, line in enumerate(lines[1:], 2):
        if not line.strip() or line.startswith(SMOOTH):
            continue
        name, sep, value = line.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError("expected 'tensor: <hex>'")
            hexs, _, zero = value.strip().partition(" ")
            z = int(zero) if zero else 128
            if not 0 <= z <= 255:
                raise ValueError(f"zero point {z} is not a uint8")
            scales[name] = (decode_scale(hexs), z)
        except ValueError as e:
            raise KilnError(f"calibration cache {path}, line {k}: {e}") from None
    return parts[2], scales


def read_smoothing(path) -> dict:
    """The smoothing lines of a cache: activation name -> float32 multipliers."""
    import numpy as np

    out = {}
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.startswith(SMOOTH):
            name, _, value = line[len(SMOOTH):].rpartition(":")
            try:
                out[name] = np.frombuffer(bytes.fromhex(value.strip()), ">f4").astype(
                    np.float32)
            except ValueError:
                raise KilnError(f"calibration cache {path}, line {k}: the smoothing "
                                "multipliers are not float32 hex") from None
    return out


def check_cache(path, algorithm: str, want: str, scales: dict[str, float],
                needed: set[str]) -> None:
    """Refuse a cache made by another calibrator than ``want`` or for other tensors than
    ``needed``."""
    if algorithm != want:
        raise KilnError(f"calibration cache {path} was made by {algorithm}, not {want} (the "
                        "calibrator asked for): pass the matching --calibrator, or delete the "
                        "cache to calibrate again")
    missing = sorted(needed - set(scales))
    extra = sorted(set(scales) - needed)
    if missing or extra:
        what = []
        if missing:
            what.append(f"{len(missing)} tensor(s) the model quantizes are missing "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        if extra:
            what.append(f"{len(extra)} tensor(s) are not in the model "
                        f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})")
        raise KilnError(f"calibration cache {path} does not match this model: "
                        f"{'; '.join(what)}. Delete it (or pass another --calib-cache) to "
                        "calibrate again")
