"""Control flow (If, Loop, Scan), sequences and optionals.

Subgraph attributes are kiln Graphs whose output types the frontend already inferred, so the
rules of If/Loop/Scan read the result types off the body. Sequence and optional ops keep rule
``None``: the frontend falls back to ONNX's own inference for them.
"""

from kiln.ir import InferCtx, TensorType
from kiln.ops.rules import norm_axis, tensor
from kiln.ops.schema import onnx_op


def _merge(a, b):
    """The type both branches of an If agree on: dims that differ become unknown."""
    if a is None or b is None or not isinstance(a, TensorType) or not isinstance(b, TensorType):
        return a if a == b else None
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return tensor(a.dtype or b.dtype, None)
    dims = [x if str(x) == str(y) else None for x, y in zip(a.shape, b.shape)]
    return tensor(a.dtype or b.dtype, dims)


def _out_types(graph) -> list:
    return [v.type for v in graph.outputs] if graph is not None else []


def if_rule(ctx: InferCtx):
    then, other = _out_types(ctx.attrs.then_branch), _out_types(ctx.attrs.else_branch)
    return [_merge(a, b) for a, b in zip(then, other)]


def _stacked(t, axis: int = 0, size=None):
    """A per-iteration tensor type stacked along ``axis`` into a scan output."""
    if not isinstance(t, TensorType):
        return None
    if t.shape is None:
        return tensor(t.dtype, None)
    shape = list(t.shape)
    shape.insert(norm_axis(axis, len(shape) + 1), size)
    return tensor(t.dtype, shape)


def loop_rule(ctx: InferCtx):
    outs = _out_types(ctx.attrs.body)[1:]
    n_carried = len(ctx.attrs.body.inputs) - 2
    carried = []
    for i, t in enumerate(outs[:n_carried]):
        init = ctx.type(2 + i)
        # a carried value whose shape changes between iterations keeps only its rank
        carried.append(init if init == t else _merge(init, t) if t is not None else init)
    return carried + [_stacked(t) for t in outs[n_carried:]]


def scan_rule(ctx: InferCtx):
    body, a = ctx.attrs.body, ctx.attrs
    outs = _out_types(body)
    n_scan = a.num_scan_inputs
    n_state = len(body.inputs) - n_scan
    n_extra = len(outs) - n_state
    scan8 = _is_scan8(ctx)
    shape = ctx.shape(n_state + int(scan8)) if n_scan else None
    if scan8:
        steps = shape[1] if shape is not None and len(shape) > 1 else None
        return list(outs[:n_state]) + [
            _stacked(t, 0, steps) if t is not None else None for t in outs[n_state:]]
    in_axes = a.scan_input_axes or (0,) * n_scan
    steps = None
    if shape is not None:
        steps = shape[norm_axis(in_axes[0], len(shape))]
    out_axes = a.scan_output_axes or (0,) * n_extra
    return list(outs[:n_state]) + [
        _stacked(t, ax, steps) for t, ax in zip(outs[n_state:], out_axes)]


def _is_scan8(ctx: InferCtx) -> bool:
    """Scan-8 has a leading sequence_lens input (possibly omitted) before the states."""
    return len(ctx.in_types) - _n_caps(ctx) == len(ctx.attrs.body.inputs) + 1


def _n_caps(ctx: InferCtx) -> int:
    return len(ctx.attrs.body.captures)


If = onnx_op("If", if_rule)
Loop = onnx_op("Loop", loop_rule)
Scan = onnx_op("Scan", scan_rule)

SequenceConstruct = onnx_op("SequenceConstruct", None)
SequenceEmpty = onnx_op("SequenceEmpty", None)
SequenceAt = onnx_op("SequenceAt", None)
SequenceInsert = onnx_op("SequenceInsert", None)
SequenceErase = onnx_op("SequenceErase", None)
SequenceLength = onnx_op("SequenceLength", None)
SplitToSequence = onnx_op("SplitToSequence", None)
ConcatFromSequence = onnx_op("ConcatFromSequence", None)
SequenceMap = onnx_op("SequenceMap", None)

Optional = onnx_op("Optional", None)
OptionalHasElement = onnx_op("OptionalHasElement", None)
OptionalGetElement = onnx_op("OptionalGetElement", None)
