"""The one table of native program planners, op -> planner (see :mod:`kiln.engine.program`):
kiln.engine.program_ops's (elementwise ops, views, pooling, 2-D convs) and those of the
modules built on its emitters."""

from __future__ import annotations

from kiln.engine import program_conv1d, program_data, program_linear, program_ops, program_rnn

PLANNERS = dict(program_ops.PLANNERS)
for _module in (program_conv1d, program_data, program_linear, program_rnn):
    PLANNERS.update(_module.PLANNERS)
