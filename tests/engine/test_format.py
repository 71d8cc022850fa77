"""The engine file: refusals (magic, checksum, truncation, version, device), atomic writes, and
no code execution on load."""

from __future__ import annotations

import builtins
import os
import pickle
import struct

import numpy as np
import pytest

import kiln
from kiln.engine import format as fmt
from kiln.errors import EngineFileError
from tests.engine.models import mlp


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("eng") / "m.kiln"
    kiln.Builder().build(mlp()).save(path)
    return path


def _copy(src, dst, mutate):
    data = bytearray(src.read_bytes())
    data = mutate(data)
    dst.write_bytes(bytes(data))
    return dst


def test_format_layout(engine_path):
    data = engine_path.read_bytes()
    assert data[:8] == fmt.MAGIC and data[-8:] == fmt.END
    h = fmt.read_header(engine_path)
    for key in ("kiln_version", "torch_version", "device", "build", "plan", "tensors"):
        assert key in h
    blob_start = (16 + struct.unpack("<I", data[12:16])[0] + 63) // 64 * 64
    assert all((blob_start + t["offset"]) % 64 == 0 for t in h["tensors"].values())


@pytest.mark.parametrize("where", [0.02, 0.3, 0.5, 0.9, -20])
def test_format_flipped_byte_is_caught(engine_path, tmp_path, where):
    def flip(d):
        i = int(len(d) * where) if where > 0 else len(d) + where
        i = max(i, 16)
        d[i] ^= 0x40
        return d
    bad = _copy(engine_path, tmp_path / "bad.kiln", flip)
    with pytest.raises(EngineFileError, match="corrupted|damaged|truncated"):
        kiln.load(bad)


@pytest.mark.parametrize("keep", [0, 5, 100, 0.5, -1])
def test_format_truncated_file_is_caught(engine_path, tmp_path, keep):
    def cut(d):
        n = int(len(d) * keep) if isinstance(keep, float) else (len(d) + keep if keep < 0
                                                                else keep)
        return d[:n]
    bad = _copy(engine_path, tmp_path / "cut.kiln", cut)
    with pytest.raises(EngineFileError):
        kiln.load(bad)


def test_format_wrong_magic(tmp_path):
    p = tmp_path / "model.onnx"
    mlp(p)
    with pytest.raises(EngineFileError, match="not a kiln engine file.*ONNX model"):
        kiln.load(p)


def test_format_missing_file(tmp_path):
    with pytest.raises(EngineFileError, match="does not exist"):
        kiln.load(tmp_path / "nope.kiln")


def test_format_newer_version_refused(engine_path, tmp_path):
    def bump(d):
        d[8:12] = struct.pack("<I", fmt.FORMAT_VERSION + 1)
        return d
    bad = _copy(engine_path, tmp_path / "new.kiln", bump)
    with pytest.raises(EngineFileError, match="newer than this kiln reads"):
        kiln.load(bad)


def test_format_other_device_refused(engine_path, tmp_path):
    ef = fmt.read_engine(engine_path)
    header = dict(ef.header, device={"kind": "cuda", "name": "NVIDIA H200",
                                     "capability": [9, 0]})
    header.pop("tensors")
    fmt.write_engine(tmp_path / "cuda.kiln", header, {k: np.array(v) for k, v in
                                                      ef.tensors.items()})
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EngineFileError, match="built for CUDA.*rebuild"):
        kiln.load(tmp_path / "cuda.kiln")


def test_format_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "m.kiln"

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        kiln.Builder().build(mlp()).save(target)
    assert list(tmp_path.iterdir()) == []


def test_format_header_read_without_weights(engine_path, tmp_path):
    def damage_blob(d):
        d[-100] ^= 0xFF
        return d
    bad = _copy(engine_path, tmp_path / "blob.kiln", damage_blob)
    assert fmt.read_header(bad)["inputs"][0]["name"] == "x"


class _Payload:
    def __reduce__(self):
        return (open, (os.environ.get("KILN_TEST_MARKER", "/tmp/kiln-pwned"), "w"))


def test_format_load_runs_no_code(engine_path, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("KILN_TEST_MARKER", str(marker))
    ef = fmt.read_engine(engine_path)
    header = dict(ef.header)
    header.pop("tensors")
    header["build"] = {"note": pickle.dumps(_Payload()).hex(), "__reduce__": "os.system"}
    tensors = {k: np.array(v) for k, v in ef.tensors.items()}
    tensors["evil"] = np.frombuffer(pickle.dumps(_Payload()), np.uint8)
    fmt.write_engine(tmp_path / "evil.kiln", header, tensors)
    calls = []
    for mod, name in ((pickle, "loads"), (pickle, "load"), (builtins, "eval"),
                      (builtins, "exec")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _o=orig, **k: (
            calls.append(_n), _o(*a, **k))[1])
    engine = kiln.load(tmp_path / "evil.kiln")
    engine.create_context().run({"x": np.ones((1, 8), np.float32)})
    assert calls == [] and not marker.exists()


def test_format_keeps_scalar_tensors(tmp_path):
    tensors = {"s": np.array(3, np.int64), "v": np.arange(3, dtype=np.float32)}
    fmt.write_engine(tmp_path / "s.kiln", {"plan": {}}, tensors)
    back = fmt.read_engine(tmp_path / "s.kiln").tensors
    assert back["s"].shape == () and int(back["s"]) == 3
    np.testing.assert_array_equal(back["v"], tensors["v"])
