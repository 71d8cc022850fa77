"""If nodes whose condition the input signature fixes, inlined into a native program's plan.

Exports test shapes and ranks with an If and keep both answers in the graph:

    x ──Shape──▶ Gather(-1) ──Equal(1)──▶ If ──then: Identity(x)
                                             └─else: Squeeze(x, -1)

silero-vad does this three times around its LSTM (nested twice inside), and every If was a
torch record that ran a sub-executor, its own program and the branch's steps from Python. The
condition here is computed from shapes only, which the plan fixes anyway (the folded shape
arithmetic of :func:`kiln.engine.program._foldable` rests on the same fact), so the traced run
puts the taken branch's steps in the If's place (their value slots renumbered into the
program's, the branch's constants added to the plan's) and plans them with the rest: records,
views and folds as if the branch had been written inline.

A slot is *fixed* when it is a constant, the ``Shape``/``Size`` of a float32 value (its shape is
the signature's, or the plan stops: a torch record that returns another shape makes the program
data-dependent) or of a fixed value, or a small integer result of a step whose inputs are all
fixed. An If whose
condition is anything else (a value the data sets) stays a torch record.
"""

from __future__ import annotations

import itertools

import torch

from kiln.engine.step import Step
from kiln.ops import control as C
from kiln.ops import tensor as T


class Inliner:
    """Renumbers the taken branches of a program's If steps into fresh slots."""

    def __init__(self, steps: list, input_slots: list, output_slots: list, consts: dict):
        used = [s for st in steps for s in st.ins + st.outs] + list(input_slots) + list(
            output_slots) + list(consts)
        self._slots = itertools.count(max(used, default=-1) + 1)
        self.consts = consts

    def branch(self, st, env: dict, fixed: set, metas: dict) -> list | None:
        """The steps that replace If step ``st`` (its outputs written to its own slots), or None
        where it is not an If with a fixed condition."""
        if getattr(st.node, "op", None) is not C.If or not st.ins or st.ins[0] not in fixed:
            return None
        cond = env.get(st.ins[0])
        runner = getattr(st.call, "run_graph", None)
        if not isinstance(cond, torch.Tensor) or cond.numel() != 1 or runner is None:
            return None
        a = st.node.attrs
        graph = a.then_branch if bool(cond.reshape(-1)[0]) else a.else_branch
        sub = runner.execs.get(id(graph))
        if sub is None or len(sub.output_slots) != len(st.outs):
            return None
        first = len(st.ins) - runner.n_caps
        where: dict[int, int] = {}
        for j, s in enumerate(sub.input_slots):  # the branch's captures: the If's inputs
            where[s] = st.ins[first + runner.index[id(graph)][j]]
        outs = sub.output_slots
        if len(set(outs)) != len(outs) or any(s in where for s in outs) or any(
                s in dict(sub.consts) for s in outs):
            return None  # an output that is a capture or a constant: no step writes it
        for s, c in sub.consts:
            where[s] = new = next(self._slots)
            self.consts[new] = env[new] = c
            fixed.add(new)
            metas[new] = _const_meta(c)
        where.update(zip(outs, st.outs))

        def slot(s: int) -> int:
            if s < 0:
                return s
            if s not in where:
                where[s] = next(self._slots)
            return where[s]

        steps = [Step(x.fn, x.call, tuple(slot(s) for s in x.ins), tuple(slot(s) for s in x.outs),
                      (), x.node) for x in sub.run_steps]
        if steps:  # the If's own frees, once its branch is done
            steps[-1].free = tuple(st.free)
        return steps


def note_fixed(st, ins: list, store: dict, fixed: set, small: dict) -> None:
    """Add the slots ``st`` just wrote to ``fixed`` where the signature fixes them."""
    if not store or any(s not in small for s in store) or st.node.subgraphs():
        return
    if getattr(st.node, "op", None) in (T.Shape, T.Size):
        x = ins[0] if ins else None
        if isinstance(x, torch.Tensor) and (st.ins[0] in fixed or (
                x.dtype == torch.float32 and x.dim() <= 6)):
            fixed.update(store)
        return
    if all(i < 0 or i in fixed for i in st.ins):
        fixed.update(store)


def _const_meta(c):
    from kiln.engine.program import _meta

    return _meta(c, ())
