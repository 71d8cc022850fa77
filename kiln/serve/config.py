"""Model configuration: ``config.pbtxt`` in protobuf text format, the subset of Triton's model
config that kiln serves (see proto/model_config.proto), checked at load time. A field kiln does
not know is refused by the parser; a known field with a bad value is refused here, always with
the file, the field and the reason."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from kiln.errors import KilnError
from kiln.serve import datatypes
from kiln.serve.proto import model_config_pb2 as mc

PLATFORMS = {"kiln": ".kiln", "onnxruntime_onnx": ".onnx"}  # platform -> model file suffix
BACKENDS = {"kiln": ".kiln", "onnxruntime": ".onnx"}


class ConfigError(KilnError):
    """A model config that cannot be served: names the file, the field and the reason."""

    def __init__(self, path, field: str, reason: str):
        super().__init__(f"{path}: {field}: {reason}")
        self.path, self.field, self.reason = str(path), field, reason


def parse_config(path: Path, text: str | None = None) -> mc.ModelConfig:
    """Parse a ``config.pbtxt``; syntax errors and unknown fields name line and column."""
    if text is None:
        text = path.read_text()
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise ConfigError(path, f"line {e.GetLine()}, column {e.GetColumn()}",
                          str(e).split(" : ", 1)[-1].replace("kiln.inference.", "")) from None
    return cfg


@dataclass(frozen=True)
class BatchPolicy:
    """What the dynamic batcher may do for one model (times in seconds)."""

    max_batch_size: int = 0  # 0: inputs have no batch dim, every request runs alone
    dynamic: bool = False
    preferred: tuple[int, ...] = ()
    max_delay: float = 0.0
    max_queue_size: int = 0  # requests waiting; 0: no limit
    default_timeout: float = 0.0  # time a request may wait in the queue; 0: no limit
    allow_timeout_override: bool = False


def batch_policy(cfg: mc.ModelConfig) -> BatchPolicy:
    if not cfg.HasField("dynamic_batching"):
        return BatchPolicy(max_batch_size=cfg.max_batch_size)
    db = cfg.dynamic_batching
    q = db.default_queue_policy
    return BatchPolicy(
        max_batch_size=cfg.max_batch_size, dynamic=cfg.max_batch_size > 0,
        preferred=tuple(sorted(db.preferred_batch_size)),
        max_delay=db.max_queue_delay_microseconds * 1e-6, max_queue_size=q.max_queue_size,
        default_timeout=q.default_timeout_microseconds * 1e-6,
        allow_timeout_override=q.allow_timeout_override)


def model_suffix(cfg: mc.ModelConfig, path) -> str | None:
    """The model file suffix the platform/backend names, or None when neither is given."""
    if cfg.platform and cfg.platform not in PLATFORMS:
        raise ConfigError(path, "platform", f"'{cfg.platform}' is not served by kiln (use one "
                          f"of {', '.join(PLATFORMS)}, or leave it out)")
    if cfg.backend and cfg.backend not in BACKENDS:
        raise ConfigError(path, "backend", f"'{cfg.backend}' is not served by kiln (use one "
                          f"of {', '.join(BACKENDS)}, or leave it out)")
    if cfg.platform:
        return PLATFORMS[cfg.platform]
    return BACKENDS[cfg.backend] if cfg.backend else None


def check_config(cfg: mc.ModelConfig, path, dir_name: str) -> None:
    """Refuse values kiln cannot serve. Called after the inputs/outputs are completed."""
    if cfg.name and cfg.name != dir_name:
        raise ConfigError(path, "name", f"'{cfg.name}' differs from the model's folder name "
                          f"'{dir_name}' (leave it out or make them equal)")
    model_suffix(cfg, path)
    if cfg.max_batch_size < 0:
        raise ConfigError(path, "max_batch_size", f"{cfg.max_batch_size} is negative")
    _check_batching(cfg, path)
    for g in cfg.instance_group:
        if g.count < 0:
            raise ConfigError(path, "instance_group.count", f"{g.count} is negative")
    _check_version_policy(cfg, path)
    _check_tensors(cfg, path)
    _check_warmup(cfg, path)


def _check_batching(cfg, path) -> None:
    if not cfg.HasField("dynamic_batching"):
        return
    db = cfg.dynamic_batching
    if cfg.max_batch_size == 0:
        raise ConfigError(path, "dynamic_batching", "needs max_batch_size > 0 (the model's "
                          "inputs must have a batch dimension to batch requests)")
    for p in db.preferred_batch_size:
        if not 1 <= p <= cfg.max_batch_size:
            raise ConfigError(path, "dynamic_batching.preferred_batch_size",
                              f"{p} is outside 1..max_batch_size ({cfg.max_batch_size})")
    if db.default_queue_policy.timeout_action == mc.ModelQueuePolicy.DELAY:
        raise ConfigError(path, "dynamic_batching.default_queue_policy.timeout_action",
                          "DELAY is not supported by kiln (use REJECT)")
    if db.priority_levels:
        raise ConfigError(path, "dynamic_batching.priority_levels",
                          "priority queues are not supported by kiln")


def _check_version_policy(cfg, path) -> None:
    vp = cfg.version_policy
    if vp.WhichOneof("policy_choice") == "latest" and vp.latest.num_versions < 1:
        raise ConfigError(path, "version_policy.latest.num_versions", "must be at least 1")
    if vp.WhichOneof("policy_choice") == "specific":
        bad = [v for v in vp.specific.versions if v < 1]
        if bad or not vp.specific.versions:
            raise ConfigError(path, "version_policy.specific.versions",
                              "must list version numbers of 1 or more")


def _check_tensors(cfg, path) -> None:
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        seen = set()
        for i, t in enumerate(tensors):
            where = f"{kind}[{i}]"
            if not t.name:
                raise ConfigError(path, f"{where}.name", "is missing")
            if t.name in seen:
                raise ConfigError(path, f"{where}.name", f"'{t.name}' appears twice")
            seen.add(t.name)
            if t.data_type == mc.TYPE_INVALID:
                raise ConfigError(path, f"{where}.data_type", f"missing for '{t.name}'")
            if datatypes.from_config(mc.DataType.Name(t.data_type)) not in datatypes.NUMPY:
                raise ConfigError(path, f"{where}.data_type", f"{mc.DataType.Name(t.data_type)}"
                                  f" is not served by kiln")
            if any(d < -1 or d == 0 for d in t.dims):
                raise ConfigError(path, f"{where}.dims", f"{list(t.dims)} for '{t.name}': each "
                                  f"dim must be positive or -1 (any size)")
            if t.HasField("reshape"):
                raise ConfigError(path, f"{where}.reshape", "is not supported by kiln")


def _check_warmup(cfg, path) -> None:
    names = {t.name for t in cfg.input}
    for i, w in enumerate(cfg.model_warmup):
        if cfg.max_batch_size and not 1 <= w.batch_size <= cfg.max_batch_size:
            raise ConfigError(path, f"model_warmup[{i}].batch_size",
                              f"{w.batch_size} is outside 1..max_batch_size")
        for name, inp in w.inputs.items():
            if name not in names:
                raise ConfigError(path, f"model_warmup[{i}].inputs", f"'{name}' is not an input "
                                  f"of the model (inputs: {', '.join(sorted(names))})")
            if inp.WhichOneof("input_data_type") == "input_data_file":
                raise ConfigError(path, f"model_warmup[{i}].inputs['{name}'].input_data_file",
                                  "is not supported by kiln (use zero_data or random_data)")


def to_text(cfg: mc.ModelConfig) -> str:
    return text_format.MessageToString(cfg)
