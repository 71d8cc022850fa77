"""The corpus manifest: entries round-trip, several exports share one file, bad manifests and
bad input specs are refused with what to do; feeds are seeded."""

import json

import numpy as np
import pytest

from bench.corpus import manifest, registry
from bench.corpus.manifest import Entry, InputSpec


def _entry(name="m", **kw):
    inputs = [InputSpec("ids", [1, 8], "int64", low=0, high=50, onnx_shape=["batch", "seq"]),
              InputSpec("x", [1, 3], "float32", onnx_shape=[-1, 3]),
              InputSpec("sr", [], "int64", value=16000)]
    return Entry(name, "encoder", "test", "torchscript", 17, inputs, batch_dynamic=True, **kw)


def test_manifest_round_trip(tmp_path):
    manifest.save({"m": _entry(outputs=["y"], bytes=10, sha256="ab")}, tmp_path)
    back = manifest.load(tmp_path)["m"]
    assert back == _entry(outputs=["y"], bytes=10, sha256="ab")
    assert back.inputs[1].onnx_shape == [-1, 3]
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["version"] == manifest.VERSION
    assert set(data["models"]["m"]) >= {"name", "source", "exporter", "opset", "inputs",
                                        "has_torch_definition", "file"}


def test_manifest_update_keeps_other_entries(tmp_path):
    manifest.update(_entry("a"), tmp_path)
    manifest.update(_entry("b"), tmp_path)
    manifest.update(_entry("a", note="again"), tmp_path)
    got = manifest.load(tmp_path)
    assert sorted(got) == ["a", "b"] and got["a"].note == "again"


def test_manifest_missing_names_the_export_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench.corpus.export"):
        manifest.load(tmp_path)


@pytest.mark.parametrize("text", ["{not json", '{"version": 99, "models": {}}',
                                  '{"version": 1, "models": {"m": {"name": "m"}}}'])
def test_manifest_malformed_is_refused(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(ValueError, match="malformed"):
        manifest.load(tmp_path)


def test_input_spec_integer_needs_a_range():
    with pytest.raises(ValueError, match="'ids'.*low < high"):
        InputSpec("ids", [1, 4], "int64")
    with pytest.raises(ValueError, match="dtype"):
        InputSpec("x", [1], "complex64")


def test_feeds_are_seeded_and_follow_the_spec():
    e = _entry()
    a, b = e.feeds(seed=3), e.feeds(seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["x"], e.feeds(seed=4)["x"])
    assert a["ids"].dtype == np.int64 and a["ids"].min() >= 0 and a["ids"].max() < 50
    assert a["sr"].shape == () and a["sr"] == 16000
    assert e.feeds(batch=4)["ids"].shape == (4, 8)


def test_registry_names_are_unique_and_sources_are_known():
    specs = registry.all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) and len(names) >= 20
    for s in specs:  # exactly one way to make each file
        assert sum(x is not None for x in (s.make, s.shipped, s.derive)) == 1, s.name
        assert s.exporter in ("torchscript", "dynamo", "shipped", "onnxruntime.quantization")
    with pytest.raises(SystemExit, match="unknown corpus models"):
        registry.select(["no_such_model"])
