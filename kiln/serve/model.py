"""Loaded models: a :class:`ModelVersion` is one engine with its instances (execution contexts)
and scheduler; a :class:`ModelManager` loads, reloads and unloads them. A reload builds the new
versions completely (engine, instances, warmup) before swapping them in; the old versions then
finish every request they hold, so none fails or is dropped."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import KilnError
from kiln.serve import datatypes
from kiln.serve.config import batch_policy
from kiln.serve.errors import not_found, unavailable
from kiln.serve.proto import model_config_pb2 as mc
from kiln.serve.repository import (
    ModelSource,
    Repository,
    complete_config,
    file_signature,
    load_engine,
    model_file,
    select_versions,
)
from kiln.serve.scheduler import Scheduler


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 name
    dims: tuple[int, ...]  # past the batch dim when the model batches; -1: any size
    optional: bool = False


class ModelVersion:
    def __init__(self, name: str, version: int, config: mc.ModelConfig, engine, signature):
        self.name, self.version, self.config, self.engine = name, version, config, engine
        self.signature = signature
        self.inputs = [_spec(t) for t in config.input]
        self.outputs = [_spec(t) for t in config.output]
        self.policy = batch_policy(config)
        count = sum(max(g.count, 1) for g in config.instance_group) or 1
        self.instances = [engine.create_context() for _ in range(count)]
        self.scheduler: Scheduler | None = None

    @property
    def batched(self) -> bool:
        return self.config.max_batch_size > 0

    def warmup(self) -> None:
        """Run the config's model_warmup samples on every instance (blocking)."""
        rng = np.random.default_rng(0)
        specs = {s.name: s for s in self.inputs}
        for w in self.config.model_warmup:
            feeds = {}
            for name, inp in w.inputs.items():
                dt = datatypes.NUMPY[datatypes.from_config(mc.DataType.Name(inp.data_type))]
                shape = ([w.batch_size] if self.batched else []) + list(inp.dims)
                if inp.WhichOneof("input_data_type") == "random_data" and dt.kind == "f":
                    feeds[name] = rng.standard_normal(shape).astype(dt)
                else:
                    feeds[name] = np.zeros(shape, dt)
            missing = [n for n in specs if n not in feeds and not specs[n].optional]
            if missing:
                raise KilnError(f"model_warmup '{w.name}' of '{self.name}' gives no data for "
                                f"input(s) {', '.join(missing)}")
            for ctx in self.instances:
                for _ in range(max(w.count, 1)):
                    ctx.run(feeds)

    def start(self, observer) -> None:
        def observe(rows, timings, ok):
            observer(self.name, str(self.version), rows, timings, ok)
        self.scheduler = Scheduler(self.policy, self.instances, observer=observe)
        self.scheduler.start()


def _spec(t) -> TensorSpec:
    dt = datatypes.from_config(mc.DataType.Name(t.data_type))
    return TensorSpec(t.name, dt, tuple(t.dims), getattr(t, "optional", False))


@dataclass
class Model:
    """A model's state: its serving versions, or why it has none."""

    name: str
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    state: str = "UNAVAILABLE"  # READY, LOADING, UNLOADING, UNAVAILABLE
    reason: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ready(self) -> bool:
        return bool(self.versions)

    def pick(self, version: str = "") -> ModelVersion:
        if not self.versions:
            raise unavailable(f"model '{self.name}' has no ready version"
                              + (f" ({self.reason})" if self.reason else ""))
        if not version:
            return self.versions[max(self.versions)]
        v = int(version) if version.isdigit() else None
        if v not in self.versions:
            raise not_found(f"model '{self.name}' has no ready version '{version}' (ready: "
                            f"{', '.join(map(str, sorted(self.versions)))})")
        return self.versions[v]


class ModelManager:
    """All models of a repository. ``observer(model, version, rows, timings, ok)`` gets every
    execution (the metrics)."""

    def __init__(self, repository: Repository, observer, log=print):
        self.repo = repository
        self.models: dict[str, Model] = {}
        self.observer = observer
        self.log = log
        self.wanted: set[str] = set()  # models that should be loaded (readiness)

    def get(self, name: str, version: str = "") -> ModelVersion:
        m = self.models.get(name)
        if m is None:
            raise not_found(f"unknown model '{name}' (served: "
                            f"{', '.join(sorted(self.models)) or 'none'})")
        return m.pick(version)

    def ready(self) -> bool:
        return all(self.models.get(n) is not None and self.models[n].ready for n in self.wanted)

    async def load(self, name: str) -> None:
        """Load or reload ``name``: new and changed versions are built before any is swapped
        in. Raises :class:`KilnError` (the config error, or the engine's) when it fails; the
        versions serving before keep serving then."""
        self.wanted.add(name)
        m = self.models.setdefault(name, Model(name))
        async with m.lock:
            m.state = "LOADING" if not m.versions else m.state
            try:
                src = await asyncio.to_thread(self.repo.read, name)
                new = await asyncio.to_thread(self._build_versions, src, m)
            except Exception as e:
                m.reason = str(e)
                m.state = "READY" if m.versions else "UNAVAILABLE"
                self.log(f"kiln serve: model '{name}' failed to load: {e}")
                raise
            for v in new.values():
                if v not in m.versions.values():
                    v.start(self.observer)
            old = [v for k, v in m.versions.items() if new.get(k) is not v]
            m.versions, m.state, m.reason = new, "READY", ""
            for v in old:  # drains: the requests they hold finish first
                await v.scheduler.close()
            self.log(f"kiln serve: model '{name}' ready, versions "
                     f"{', '.join(map(str, sorted(new)))}")

    def _build_versions(self, src: ModelSource, m: Model) -> dict[int, ModelVersion]:
        out = {}
        for v in select_versions(src):
            old = m.versions.get(v)
            vsig = version_signature(src, v)
            if old is not None and old.signature == vsig:
                out[v] = old
                continue
            path = model_file(src, v)
            engine = load_engine(path, src.config, self.repo.cache_dir, self.log)
            cfg = complete_config(src, engine, path)
            mv = ModelVersion(src.name, v, cfg, engine, vsig)
            mv.warmup()
            out[v] = mv
        return out

    async def unload(self, name: str) -> None:
        self.wanted.discard(name)
        m = self.models.get(name)
        if m is None:
            raise not_found(f"unknown model '{name}'")
        async with m.lock:
            old, m.versions, m.state = list(m.versions.values()), {}, "UNLOADING"
            for v in old:
                await v.scheduler.close()
            m.state, m.reason = "UNAVAILABLE", "unloaded"

    async def close(self) -> None:
        for name in list(self.models):
            for v in list(self.models[name].versions.values()):
                await v.scheduler.close()

    def index(self) -> list[dict]:
        """The repository index: every model folder and loaded version with its state."""
        out = []
        names = set(self.repo.model_names()) | set(self.models)
        for name in sorted(names):
            m = self.models.get(name)
            if m is None or not m.versions:
                entry = {"name": name, "state": m.state if m else "UNAVAILABLE"}
                if m is not None and m.reason:
                    entry["reason"] = m.reason
                out.append(entry)
                continue
            for v in sorted(m.versions):
                out.append({"name": name, "version": str(v), "state": "READY"})
        return out

    def pending(self) -> dict:
        return {(n, str(v)): mv.scheduler.pending for n, m in self.models.items()
                for v, mv in m.versions.items() if mv.scheduler is not None}


def version_signature(src: ModelSource, version: int) -> tuple:
    """Changes when the model's config or the version folder's files change."""
    cfg = src.config_path.stat().st_mtime_ns if src.config_path.is_file() else None
    return (cfg, file_signature(src.versions[version]))
