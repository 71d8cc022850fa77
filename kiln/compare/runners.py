"""Runners: one way to run a model each, all with the same interface (Polygraphy's shape).

A runner has a ``name``, ``run(feeds) -> {output: array}``, and ``run_all(feeds) ->
{tensor: array}`` (every intermediate it can show, for layer-by-layer comparison).
"""

from __future__ import annotations

import numpy as np
import onnx


class OnnxruntimeRunner:
    """onnxruntime on the CPU, graph optimizations off (the ONNX graph as written)."""

    name = "onnxruntime"

    def __init__(self, model_path):
        self.path = str(model_path)
        self._sess = self._session(onnx.load(self.path))

    @staticmethod
    def _session(model):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])

    def run(self, feeds):
        names = [o.name for o in self._sess.get_outputs()]
        return dict(zip(names, self._sess.run(names, feeds)))

    def run_all(self, feeds, names=None):
        model = onnx.load(self.path)
        have = {o.name for o in model.graph.output}
        for n in model.graph.node:
            for o in n.output:
                if o and o not in have and (names is None or o in names):
                    model.graph.output.append(onnx.ValueInfoProto(name=o))
        sess = self._session(model)
        outs = [o.name for o in sess.get_outputs()]
        return dict(zip(outs, sess.run(outs, feeds)))


class ReferenceRunner:
    """The ONNX reference evaluator (``onnx.reference``): slow, independent of both."""

    name = "reference"

    def __init__(self, model_path):
        from onnx.reference import ReferenceEvaluator

        self.model = onnx.load(str(model_path))
        self._ev = ReferenceEvaluator(self.model)

    def run(self, feeds):
        names = [o.name for o in self.model.graph.output]
        return dict(zip(names, self._ev.run(None, feeds)))

    def run_all(self, feeds, names=None):
        from onnx.reference import ReferenceEvaluator

        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        for n in model.graph.node:
            for o in n.output:
                if o and (names is None or o in names):
                    model.graph.output.append(onnx.ValueInfoProto(name=o))
        ev = ReferenceEvaluator(model)
        outs = [o.name for o in model.graph.output]
        return dict(zip(outs, ev.run(None, feeds)))


class KilnRunner:
    """A kiln engine (loaded from a file, or built). ``run_all`` shows every layer output that
    survived fusion, by its tensor name."""

    def __init__(self, engine, name: str = "kiln"):
        self.engine, self.name = engine, name

    def run(self, feeds):
        return self.engine.create_context().run(feeds)

    def run_all(self, feeds, names=None):
        from kiln.engine.tap import run_tapped

        got: dict[str, np.ndarray] = {}
        outs = run_tapped(self.engine.executor_for(0), feeds,
                          lambda n, x, node: got.__setitem__(n, x), names)
        return {**got, **outs}

    def layer_of(self) -> dict[str, str]:
        """Tensor name -> the (fused) layer that writes it."""
        return {v.name: n.name for n in self.engine.graph.nodes for v in n.outputs}


def make_runner(kind: str, model_path, **build_kw):
    """A reference runner by its CLI name: onnxruntime, reference, kiln-fp32."""
    if kind == "onnxruntime":
        return OnnxruntimeRunner(model_path)
    if kind == "reference":
        return ReferenceRunner(model_path)
    if kind == "kiln-fp32":
        from kiln.builder import Builder, BuilderConfig

        return KilnRunner(Builder(BuilderConfig(**build_kw)).build(str(model_path)), "kiln-fp32")
    raise ValueError(f"unknown reference {kind!r}: onnxruntime, reference or kiln-fp32")
