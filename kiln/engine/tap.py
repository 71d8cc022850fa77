"""Run a graph and see its intermediate values: calibration and layer-by-layer comparison.

:func:`run_tapped` walks an executor's steps one by one (never the native chains, whose
intermediates stay inside C) and hands each value whose name is asked for to ``on_value``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kiln.engine.executor import Executor
from kiln.engine.step import store_outputs
from kiln.kernels.torch.convert import to_numpy, to_torch


def run_tapped(ex: Executor, feeds: dict[str, np.ndarray], on_value: Callable,
               names: set[str] | None = None) -> dict[str, np.ndarray]:
    """Run ``ex`` on ``feeds`` (by input name); call ``on_value(name, array, node)`` for the
    graph inputs and every node output whose name is in ``names`` (all when None), in
    execution order (``node`` None for inputs). Returns the graph outputs."""
    g = ex.graph
    args = [to_torch(np.asarray(feeds[v.name])) for v in g.inputs]
    for v, a in zip(g.inputs, args):
        if names is None or v.name in names:
            on_value(v.name, to_numpy(a), None)
    env = ex._env(args)
    with torch.inference_mode():
        for st in ex.steps:
            store_outputs(st, env, ex._call(st, env, None))
            for v, s in zip(st.node.outputs, st.outs):
                if names is None or v.name in names:
                    x = env[s]
                    if isinstance(x, (torch.Tensor, np.ndarray)):
                        on_value(v.name, to_numpy(x), st.node)
    return {v.name: to_numpy(env[s]) for v, s in zip(g.outputs, ex.output_slots)}
