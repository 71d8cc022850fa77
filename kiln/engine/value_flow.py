"""Can the values of a graph's inputs set a shape or a branch?

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

Float inputs are followed too, more loosely, since float data reaches every op: a float value
computed from a float input only blocks where it is itself a shape operand
(:data:`FLOAT_SHAPE_POSITIONS`: Range's bounds, Resize's scales); where a node turns it into an
integer or bool (``Cast``, ``ArgMax``, a comparison), that result is carried as an integer
input's values are (``Cast(x) -> Reshape`` shape blocks, ``ArgMax(x) -> Gather`` does not).
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
        "LayerNormalization", "RMSNormalization", "MatMul", "Gemm", "Transpose", "Concat",
        "Flatten", "Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements",
        "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitShift", "Shape", "Size",
        "ArgMax", "ArgMin", "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
        "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv",
        # the result's shape depends on the values, which the program checks at run time:
        # a torch record whose float result changes shape stops it (program._DataDependent)
        "NonZero")},
    # the first input is data, the others set the output's shape (or are left to block)
    **{("", op): {0} for op in (
        "Reshape", "Expand", "Slice", "Squeeze", "Unsqueeze", "Tile", "Split", "ReduceMean",
        "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "TopK", "CumSum",
        "Resize", "Trilu")},
    ("", "Clip"): ALL,  # min and max bound values, not shapes
    # sequence lengths mask the steps; the outputs' shapes come from the inputs' shapes
    **{("", op): ALL for op in ("RNN", "GRU", "LSTM")},
    ("com.microsoft", "DynamicQuantizeLSTM"): ALL,
    ("", "Pad"): {0, 2},  # the fill value is data; pads and axes set the shape
    **{("kiln", op): ALL for op in (
        "FusedPointwise", "FusedMatMul", "FusedGemm", "FusedConv", "FusedMatMulLayerNorm",
        "Attention", "SqueezeExcite",
        # quantized layers: the weights and quantization parameters are constants; the
        # activation is data (a dynamic layer's scale comes from its values, not its shape)
        "Int8MatMul", "Int8MatMulQDQ", "Int8Conv", "QuantizeDequantize", "ConvIntegerScaled",
        "QLinearMatMulQDQ", "DynamicConvInteger", "DynamicMatMulInteger")},
}
# ops with subgraphs: the operands that pick the branch or the trip count (their other operands
# are the body's inputs and captures, which the body's own executor checks; a float result that
# comes out of them in another shape than traced stops the program at run time)
CONTROL_POSITIONS = {("", "If"): {0}, ("", "Loop"): {0, 1}, ("", "Scan"): set()}
# ops whose results depend on shapes alone: they do not carry their inputs' values
META_OPS = {("", "Shape"), ("", "Size")}
# positions where a float operand sets the output's shape
FLOAT_SHAPE_POSITIONS: dict[tuple[str, str], set[int] | None] = {
    ("", "Range"): ALL, ("", "Resize"): {2}, ("", "Upsample"): {1}}


def shape_setting_use(graph: Graph, fixed: frozenset = frozenset()) -> str | None:
    """Where the values of ``graph``'s inputs and captures (except those named in ``fixed``:
    constants of an outer graph) reach an operand that may set a shape or a branch, as
    "node 'name' (Op) input k, from 'graph input'"; None where they reach plain data only."""
    carried: dict[int, str] = {}  # id(value) -> the graph input whose values it carries
    floats: dict[int, str] = {}  # the same for float values computed from float inputs
    for v in graph.inputs + graph.captures:
        if v.name not in fixed:
            (floats if _is_float(v) else carried)[id(v)] = v.name
    for n in graph.nodes:
        key = (n.op.domain, n.op.name)
        where = _blocked_at(n, key, carried, floats)
        if where is not None:
            return where
        if key in META_OPS:
            continue
        src = next((carried[id(v)] for v in n.inputs if v is not None and id(v) in carried),
                   None)
        fsrc = next((floats[id(v)] for v in n.inputs if v is not None and id(v) in floats),
                    None)
        for o in n.outputs:
            if o is None:
                continue
            if src is not None:
                carried[id(o)] = src
            elif fsrc is not None:  # float data turned into integers starts being followed
                (floats if _is_float(o) else carried)[id(o)] = fsrc
    return None


def _is_float(v) -> bool:
    """(A value of unknown dtype is not: followed as an integer, the conservative way.)"""
    t = v.type
    return isinstance(t, TensorType) and t.dtype is not None and t.dtype.is_float


def _blocked_at(n, key, carried: dict, floats: dict) -> str | None:
    data = DATA_POSITIONS.get(key, set())
    if n.subgraphs():  # If / Loop / Scan: a carried condition or trip count blocks
        control = CONTROL_POSITIONS.get(key)
        data = set() if control is None else set(range(len(n.inputs))) - control
    float_shape = FLOAT_SHAPE_POSITIONS.get(key, set())
    for k, v in enumerate(n.inputs):
        if v is None:
            continue
        if id(v) in carried and data is not ALL and k not in data:
            return f"node '{n.name}' ({n.op.name}) input {k}, from '{carried[id(v)]}'"
        if id(v) in floats and (float_shape is ALL or k in float_shape):
            return f"node '{n.name}' ({n.op.name}) input {k}, from '{floats[id(v)]}'"
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
