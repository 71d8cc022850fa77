"""Can the values of a graph's integer and bool inputs set a shape or a branch?

A native program (:mod:`kiln.engine.program`) is planned per input signature (shapes, strides,
dtypes), not per input value: its records keep the traced run's shapes and its planners read
shape operands only where they are constants. That is right for an integer input whose values
only reach arithmetic (token ids gathered from an embedding, an attention mask cast and added
to scores); it would be silently wrong for one whose values reach a Reshape shape, Slice
bounds, a Range, an If condition. :func:`shape_setting_use` follows the values of the graph's
non-float inputs through the nodes and names the first place where they reach an operand that
is not known to be plain data.

The check is conservative: a node's outputs carry its inputs' values (every output of every
node that reads one), except ``Shape`` and ``Size``, whose results depend on shapes alone (and
shapes stay fixed by the signature as long as no value reaches a shape operand). An operand
counts as plain data only where :data:`DATA_POSITIONS` says so; any other op, or position, that
a carried value reaches blocks the program.
"""

from __future__ import annotations

from kiln.ir import Graph
from kiln.ir.types import TensorType

ALL = None  # every input position is plain data

# ops whose output shapes depend on their inputs' shapes and attributes alone, whatever the
# values at these positions (None: all of them)
DATA_POSITIONS: dict[tuple[str, str], set[int] | None] = {
    **{("", op): ALL for op in (
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Equal", "Less",
        "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not", "Where", "Cast",
        "CastLike", "Neg", "Abs", "Sqrt", "Exp", "Log", "Sin", "Cos", "Tan", "Tanh", "Sigmoid",
        "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Softplus", "Softsign", "Erf", "Gelu",
        "HardSigmoid", "HardSwish", "Mish", "PRelu", "Sign", "Floor", "Ceil", "Round",
        "Reciprocal", "IsNaN", "IsInf", "Identity", "Softmax", "LogSoftmax",
        "LayerNormalization", "MatMul", "Gemm", "Transpose", "Concat", "Flatten", "Gather",
        "GatherElements", "GatherND", "ScatterND", "ScatterElements", "BitwiseAnd",
        "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitShift", "Shape", "Size")},
    # the first input is data, the others set the output's shape (or are left to block)
    **{("", op): {0} for op in (
        "Reshape", "Expand", "Slice", "Squeeze", "Unsqueeze", "Tile", "Split", "ReduceMean",
        "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "TopK", "CumSum",
        "Resize", "Trilu")},
    ("", "Clip"): ALL,  # min and max bound values, not shapes
    ("", "Pad"): {0, 2},  # the fill value is data; pads and axes set the shape
    **{("kiln", op): ALL for op in (
        "FusedPointwise", "FusedMatMul", "FusedGemm", "FusedConv", "FusedMatMulLayerNorm",
        "Attention", "SqueezeExcite")},
}
# ops whose results depend on shapes alone: they do not carry their inputs' values
META_OPS = {("", "Shape"), ("", "Size")}


def shape_setting_use(graph: Graph, fixed: frozenset = frozenset()) -> str | None:
    """Where the values of ``graph``'s non-float inputs and captures (except those named in
    ``fixed``: constants of an outer graph) reach an operand that may set a shape or a branch,
    as "node 'name' (Op) input k, from 'graph input'"; None where they reach plain data only."""
    carried: dict[int, str] = {}  # id(value) -> the graph input whose values it carries
    for v in graph.inputs + graph.captures:
        float_in = isinstance(v.type, TensorType) and v.type.dtype.is_float
        if not float_in and v.name not in fixed:
            carried[id(v)] = v.name
    if not carried:
        return None
    for n in graph.nodes:
        key = (n.op.domain, n.op.name)
        data = DATA_POSITIONS.get(key, set())
        if n.subgraphs():
            data = set()  # If / Loop / Scan: a carried condition, count or capture blocks
        src = None
        for k, v in enumerate(n.inputs):
            if v is None or id(v) not in carried:
                continue
            if data is not ALL and k not in data:
                return (f"node '{n.name}' ({n.op.name}) input {k}, from "
                        f"'{carried[id(v)]}'")
            src = src or carried[id(v)]
        if src is not None and key not in META_OPS:
            carried.update((id(o), src) for o in n.outputs if o is not None)
    return None


def shape_setting_inputs(graph: Graph, fixed: frozenset = frozenset()) -> set[str]:
    """The names of every non-float input and capture of ``graph`` (except those in ``fixed``)
    whose values reach an operand that may set a shape or a branch (where
    :func:`shape_setting_use` stops at the first): a native program planned per *value* of
    these (:class:`kiln.engine.program.Program`'s ``keyed``) keeps what it folds right."""
    carried: dict[int, frozenset] = {}  # id(value) -> the graph inputs whose values it carries
    for v in graph.inputs + graph.captures:
        float_in = isinstance(v.type, TensorType) and v.type.dtype.is_float
        if not float_in and v.name not in fixed:
            carried[id(v)] = frozenset([v.name])
    found: set[str] = set()
    for n in graph.nodes:
        key = (n.op.domain, n.op.name)
        data = set() if n.subgraphs() else DATA_POSITIONS.get(key, set())
        src: frozenset = frozenset()
        for k, v in enumerate(n.inputs):
            if v is None or id(v) not in carried:
                continue
            if data is not ALL and k not in data:
                found |= carried[id(v)]
            src |= carried[id(v)]
        if src and key not in META_OPS:
            carried.update((id(o), src) for o in n.outputs if o is not None)
    return found
