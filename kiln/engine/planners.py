"""The one table of native program planners, op -> planner (see :mod:`kiln.engine.program`):
kiln.engine.program_ops's (elementwise ops, views, pooling, 2-D convs) and those of the
modules built on its emitters (program_int8: INT8 layers on kiln's qgemm)."""

from __future__ import annotations

from kiln.engine import (
    program_conv1d,
    program_data,
    program_gemm,
    program_int8,
    program_linear,
    program_ops,
    program_rnn,
)


def _as_traced(planner):
    """``planner``, where the traced run of the node took kiln's GEMM (or no CPU GEMM tactic
    at all): a node the tuner gave F.linear stays a torch record, so that planned runs compute
    what the traced one did."""
    def plan(pc, st, ins, outs):
        lin = st.call.cache.get("lin_plans") or {}
        if any(getattr(f, "tactic", "kiln") != "kiln" for f in lin.values()):
            return None
        return planner(pc, st, ins, outs)
    return plan


def _first(*planners):
    """The first of ``planners`` that plans the step."""
    def plan(pc, st, ins, outs):
        for p in planners:
            got = p(pc, st, ins, outs)
            if got is not None:
                return got
        return None
    return plan


PLANNERS = dict(program_ops.PLANNERS)
# where several modules plan an op, the first in this order that plans the step: program_ops's
# view of a Gather of one index before program_data's gather; program_linear's lone FusedGemm /
# FusedMatMul (it copies a strided input to rows) before program_gemm's GEMM records (MatMul,
# FusedMatMul with a residual or LayerNorm, Gemm, FusedGemm, LayerNorm, RMSNorm, Attention),
# which apply where the traced run took kiln's GEMM
for _module in (program_conv1d, program_data, program_linear, program_rnn, program_gemm,
                program_int8):
    for _op, _planner in _module.PLANNERS.items():
        if _module is program_gemm:
            _planner = _as_traced(_planner)
        PLANNERS[_op] = _first(PLANNERS[_op], _planner) if _op in PLANNERS else _planner
