"""The model repository and config.pbtxt: parsing, refusals naming file/field/reason, version
policies, platform inferred from the file, ONNX versions built once and cached, configs
completed from and checked against the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.serve.config import ConfigError, batch_policy, check_config, parse_config
from kiln.serve.model import ModelVersion
from kiln.serve.repository import (
    Repository,
    complete_config,
    load_engine,
    model_file,
    select_versions,
)
from tests.serve.conftest import matmul_model, write_model

CFG = Path("m/config.pbtxt")


def test_config_full_subset_parses():
    cfg = parse_config(CFG, """
        name: "m"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
        dynamic_batching {
          preferred_batch_size: [ 8, 4 ]
          max_queue_delay_microseconds: 250
          default_queue_policy { max_queue_size: 3 default_timeout_microseconds: 5000 }
        }
        instance_group [ { count: 2 kind: KIND_CPU } ]
        version_policy: { latest: { num_versions: 2 } }
        model_warmup [ { name: "w" batch_size: 2 inputs { key: "x" value {
            data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]
    """)
    check_config(cfg, CFG, "m")
    p = batch_policy(cfg)
    assert (p.max_batch_size, p.dynamic, p.preferred, p.max_queue_size) == (8, True, (4, 8), 3)
    assert p.max_delay == pytest.approx(250e-6) and p.default_timeout == pytest.approx(5e-3)


@pytest.mark.parametrize("text, field, reason", [
    ("optimization { }", "line 1, column 1", 'no field named "optimization"'),
    ("max_batch_size: -1", "max_batch_size", "negative"),
    ("dynamic_batching { }", "dynamic_batching", "max_batch_size > 0"),
    ("max_batch_size: 4 dynamic_batching { preferred_batch_size: 5 }",
     "dynamic_batching.preferred_batch_size", "outside 1..max_batch_size"),
    ('platform: "tensorrt_plan"', "platform", "not served by kiln"),
    ('name: "other"', "name", "differs from the model's folder name"),
    ("version_policy { specific { } }", "version_policy.specific.versions", "version numbers"),
    ('input [ { name: "x" dims: [ 4 ] } ]', "input[0].data_type", "missing"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 0 ] } ]', "input[0].dims", "positive"),
    ('input [ { name: "x" data_type: TYPE_FP32 }, { name: "x" data_type: TYPE_FP32 } ]',
     "input[1].name", "appears twice"),
    ("max_batch_size: 2 dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
     "dynamic_batching.default_queue_policy.timeout_action", "DELAY"),
])
def test_config_refused_with_file_field_reason(text, field, reason):
    with pytest.raises(ConfigError) as e:
        check_config(parse_config(CFG, text), CFG, "m")
    assert e.value.path == str(CFG) and e.value.field == field and reason in e.value.reason
    assert str(e.value).startswith(f"{CFG}: {field}: ")


def test_repository_version_policies(tmp_path):
    for v in (1, 2, 3):
        write_model(tmp_path, "m", v, matmul_model())
    repo = Repository(tmp_path)
    for text, want in (("", [3]), ("version_policy { all { } }", [1, 2, 3]),
                       ("version_policy { latest { num_versions: 2 } }", [2, 3]),
                       ("version_policy { specific { versions: [ 1, 3 ] } }", [1, 3])):
        (tmp_path / "m" / "config.pbtxt").write_text(text)
        assert select_versions(repo.read("m")) == want
    (tmp_path / "m" / "config.pbtxt").write_text("version_policy { specific { versions: 7 } }")
    with pytest.raises(ConfigError, match=r"version\(s\) \[7\] have no folder"):
        select_versions(repo.read("m"))


def test_repository_onnx_built_once_and_cached(tmp_path):
    write_model(tmp_path, "m", 1, matmul_model(), "max_batch_size: 4\n")
    repo = Repository(tmp_path)
    src = repo.read("m")
    path = model_file(src, 1)
    logs: list[str] = []
    e1 = load_engine(path, src.config, None, logs.append)
    e2 = load_engine(path, src.config, None, logs.append)
    assert sum("building" in m for m in logs) == 1  # the second load read the cache
    assert list((path.parent / ".kiln-cache").glob("*.kiln"))
    assert [i.name for i in e2.inputs] == [i.name for i in e1.inputs] == ["x"]


def test_repository_config_completed_from_engine(tmp_path):
    write_model(tmp_path, "m", 1, matmul_model(), "max_batch_size: 4\n"
                "instance_group [ { count: 2 } ]\n"
                'model_warmup [ { name: "w" batch_size: 3 inputs { key: "x" value {'
                " data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]\n")
    src = Repository(tmp_path).read("m")
    path = model_file(src, 1)
    engine = load_engine(path, src.config, None, lambda m: None)
    cfg = complete_config(src, engine, path)
    assert cfg.name == "m" and cfg.platform == "onnxruntime_onnx"
    assert [(t.name, list(t.dims)) for t in cfg.input] == [("x", [4])]
    mv = ModelVersion("m", 1, cfg, engine, ())
    assert len(mv.instances) == 2
    mv.warmup()  # runs the warmup sample on both instances


def test_repository_config_mismatching_engine_refused(tmp_path):
    write_model(tmp_path, "m", 1, matmul_model(), "max_batch_size: 4\n"
                'input [ { name: "x" data_type: TYPE_FP32 dims: [ 5 ] } ]\n')
    src = Repository(tmp_path).read("m")
    path = model_file(src, 1)
    engine = load_engine(path, src.config, None, lambda m: None)
    with pytest.raises(ConfigError, match=r"input\[0\]\.dims: \[5\] for 'x' do not fit"):
        complete_config(src, engine, path)


def test_repository_missing_model_file_refused(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    src = Repository(tmp_path).read("m")
    with pytest.raises(ConfigError, match="no .kiln or .onnx file"):
        model_file(src, 1)
