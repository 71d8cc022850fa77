"""Reading ONNX files (paths, bytes or ModelProto), with external data kept in the model folder."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto

from kiln.errors import ModelLoadError


def load_model(src, base_dir: str | os.PathLike | None = None) -> ModelProto:
    """Return a ModelProto with all external data read in.

    ``src`` is a path, the bytes of a model, or a ModelProto. External data is looked up
    relative to the model's folder (``base_dir`` for bytes and protos); a location that is
    absolute or climbs out of that folder is refused.
    """
    if isinstance(src, ModelProto):
        model = src
    elif isinstance(src, (bytes, bytearray, memoryview)):
        model = _parse(bytes(src), "<bytes>")
    elif isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if not path.exists():
            raise ModelLoadError(f"model file '{path}' does not exist; check the path")
        if path.is_dir():
            raise ModelLoadError(f"'{path}' is a folder, not an ONNX model file")
        model = _parse(path.read_bytes(), str(path))
        base_dir = base_dir or path.parent
    else:
        raise ModelLoadError(
            f"cannot load a model from a {type(src).__name__}; give a path, bytes or a ModelProto")
    if _has_external(model):
        _load_external(model, Path(base_dir) if base_dir is not None else None)
    return model


def _parse(data: bytes, where: str) -> ModelProto:
    model = ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(
            f"{where} is not a valid ONNX model: the protobuf could not be parsed ({e}). "
            "Re-export the model or check the file is complete.") from None
    if not model.HasField("graph"):
        raise ModelLoadError(f"{where} is not a valid ONNX model: it has no graph. "
                             "Re-export the model or check the file is complete.")
    return model


def _tensors(model: ModelProto):
    yield from onnx.external_data_helper._get_all_tensors(model)


def _has_external(model: ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for t in _tensors(model))


def _load_external(model: ModelProto, base: Path | None) -> None:
    for t in _tensors(model):
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if base is None:
            raise ModelLoadError(
                f"tensor '{t.name}' keeps its data in external file '{loc}', but the model was "
                "given as bytes/proto without a folder; pass base_dir= or load it from its path")
        file = _safe_path(base, loc, t.name)
        offset, length = int(info.get("offset", 0)), info.get("length")
        with open(file, "rb") as f:
            f.seek(offset)
            data = f.read(int(length)) if length is not None else f.read()
        if length is not None and len(data) != int(length):
            raise ModelLoadError(
                f"external data file '{file}' for tensor '{t.name}' is truncated: wanted "
                f"{length} bytes at offset {offset}, got {len(data)}")
        t.raw_data = data
        del t.external_data[:]
        t.data_location = TensorProto.DEFAULT


def _safe_path(base: Path, loc: str, tensor: str) -> Path:
    if not loc:
        raise ModelLoadError(f"tensor '{tensor}' is marked external but names no location")
    p = Path(loc)
    if p.is_absolute() or ".." in p.parts:
        raise ModelLoadError(
            f"tensor '{tensor}' points to external data '{loc}' outside the model's folder; "
            "kiln only reads external data files that sit beside the model (no absolute "
            "paths, no '..')")
    full = (base / p).resolve()
    if base.resolve() not in full.parents and full != base.resolve():
        raise ModelLoadError(
            f"tensor '{tensor}' points to external data '{loc}' that resolves outside the "
            "model's folder (a symlink?); move the data file beside the model")
    if not full.is_file():
        raise ModelLoadError(
            f"tensor '{tensor}' needs external data file '{loc}', which is missing from "
            f"'{base}'; copy it beside the model")
    return full
