"""Builder: ONNX model -> optimized graph -> kernel choice per layer -> Engine."""

from __future__ import annotations

import time
from typing import Callable

from kiln.build.config import BuilderConfig
from kiln.build.precision import lower_precision
from kiln.engine.engine import Engine, TensorInfo
from kiln.engine.profile import validate_profile
from kiln.errors import KilnError
from kiln.frontend import import_onnx
from kiln.ir import Graph
from kiln.kernels.registry import kernels_for
from kiln.passes.pipeline import optimize


class Builder:
    """Builds engines: ``Builder(BuilderConfig(...)).build("model.onnx")``.

    ``log`` receives one line per step (what the CLI prints with ``--verbose``).
    """

    def __init__(self, config: BuilderConfig | None = None, log: Callable[[str], None] = None):
        self.config = config or BuilderConfig()
        self.log = log or (lambda msg: None)
        self.report: dict = {}

    def build(self, model, base_dir=None) -> Engine:
        """Build from a path, the bytes of a model, or a ``ModelProto``.

        Raises :class:`kiln.errors.KilnError` subclasses for unreadable models, unsupported
        ops (all listed at once) and profiles that do not fit the model's inputs."""
        cfg, t0 = self.config, time.perf_counter()
        graph = import_onnx(model, base_dir)
        t_parse = time.perf_counter()
        self.log(f"parsed {len(graph.nodes)} nodes, {len(graph.weights)} weights "
                 f"in {1e3 * (t_parse - t0):.0f} ms")
        for p in cfg.profiles:
            validate_profile(p, [TensorInfo.of(v) for v in graph.inputs])
        before = graph.op_counts()
        if cfg.optimize:
            graph = optimize(graph, log=self.log)
        if cfg.fp16 or cfg.bf16:  # FP16 when both are allowed: more mantissa, same speed
            lower_precision(graph, "fp16" if cfg.fp16 else "bf16", log=self.log)
        choices = self._choose_kernels(graph)
        t_end = time.perf_counter()
        self.report = {"nodes_before": before, "nodes_after": graph.op_counts(),
                       "parse_s": t_parse - t0, "total_s": t_end - t0}
        self.log(f"built {len(graph.nodes)} layers in {t_end - t0:.2f} s")
        build = dict(cfg.to_json(), build_seconds=round(t_end - t0, 3))
        return Engine(graph, choices, device=cfg.device, profiles=cfg.profiles, build=build)

    def _choose_kernels(self, graph: Graph) -> dict[str, str]:
        backend = self.config.device
        choices: dict[str, str] = {}
        for n in _all_nodes(graph):
            ks = kernels_for(n.op, backend) or kernels_for(n.op, "cpu")
            if not ks:
                raise KilnError(f"node '{n.name}': op {n.op.qualname} has no {backend} kernel")
            choices[n.name] = ks[0].name
        return choices


def _all_nodes(graph: Graph):
    for n in graph.nodes:
        yield n
        for g in n.subgraphs():
            yield from _all_nodes(g)
