"""Constant folding: nodes whose inputs are all known at build time become constant Values.

Exported models carry their shape arithmetic as nodes:

    x ──Shape──▶ [batch, seq, 768] ──Gather(0)──▶ batch ──Unsqueeze──▶ [batch] ─┐
                                          Constant [-1], [12], [64] ────────────┴─Concat─▶ Reshape

``fold_constants`` evaluates a node once with its CPU kernel when every input is a constant
(weights, Constant nodes, earlier folds) and replaces it by constant outputs; a node whose int
outputs the shape rules know exactly (``Value.sym`` all ints: ``Shape`` of a static tensor,
``Shape(x)[2]`` when dim 2 is static) folds too, without running anything. ``fold_shape_inputs``
then rewrites the shape input of a Reshape whose target is still symbolic ([batch, -1, 12, 64])
into a constant that means the same thing ([0, -1, 12, 64]: 0 copies the input's dim), which
leaves the Shape/Gather/Unsqueeze/Concat chain dead for ``eliminate`` to drop.

A folded Value keeps its type, gets ``.const`` and loses its producer: the executor preloads it
and the engine file stores it with the node constants.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.rewrite import is_graph_output
from kiln.ir.types import is_static
from kiln.kernels.registry import Call, kernels_for
from kiln.ops import control as C
from kiln.ops import random as R
from kiln.ops import tensor as T

FOLD_CAP = 64 << 20  # bytes; a bigger result stays a node unless it is a weight transform
# random ops must draw anew on every run, so they are never evaluated at build time
NOT_FOLDABLE = {R.RandomUniform, R.RandomNormal, R.RandomUniformLike, R.RandomNormalLike,
                R.Bernoulli, R.Multinomial, C.SequenceEmpty}


def fold_constants(graph: Graph, log: Callable[[str], None]) -> int:
    """Evaluate every node whose inputs are constants; returns how many nodes were folded."""
    n = 0
    for g in graph_and_subgraphs(graph):
        n += _fold_graph(g, log)
    return n


def _fold_graph(graph: Graph, log) -> int:
    folded: list[Node] = []
    for node in graph.nodes:
        if not _foldable(graph, node):
            continue
        outs = _values_from_syms(node)
        how = "shape"
        if outs is None and _inputs_const(node):
            outs, how = _evaluate(graph, node), "eval"
        if outs is None:
            outs, how = _zero_product(node), "x * 0"
        if outs is None:
            continue
        for v, arr in zip(node.outputs, outs):
            v.const, v.producer = arr, None
            v.type = _known_shape(v.type, arr)
        folded.append(node)
        log(f"folded {node.name} ({node.op.name}, {how})")
    if folded:
        dead = {id(n) for n in folded}
        graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    _constant_captures(graph)
    return len(folded)


def _constant_captures(graph: Graph) -> None:
    """A subgraph's captured value is a constant where the outer value is: the subgraph's own
    folding (it runs after this graph's) then sees through it, as it sees through its own
    weights (silero-vad slices and unsqueezes its LSTM weights inside an If branch from outer
    constants, which otherwise ran on every inference and repacked the weights each time). The
    owner still feeds the capture at run time, with the same value."""
    for node in graph.nodes:
        subgraphs = node.subgraphs()
        if not subgraphs:
            continue
        outer = {v.name: v for v in node.inputs if v is not None}
        for g in subgraphs:
            for c in g.captures:
                v = outer.get(c.name)
                if v is not None and v.const is not None and c.const is None:
                    c.const = v.const


def _known_shape(t: TensorType, arr: np.ndarray) -> TensorType:
    """A folded value's type with the shape its array has (the import may not have known it:
    the readers' shape rules see it when ``refine_shapes`` runs them again)."""
    if t.shape is None or (len(t.shape) == arr.ndim and not is_static(t.shape)):
        return TensorType(t.dtype, tuple(int(d) for d in arr.shape))
    return t


def _foldable(graph: Graph, node: Node) -> bool:
    # a constant graph output would have no producer to fill it at run time: keep the node
    if node.op in NOT_FOLDABLE or node.subgraphs() or not node.outputs:
        return False
    if any(is_graph_output(graph, v) for v in node.outputs):
        return False
    return all(isinstance(v.type, TensorType) for v in node.outputs)


def _zero_product(node: Node) -> list[np.ndarray] | None:
    """``x * 0`` of integers, x unknown: zeros of the output's (static) shape. (Not for floats:
    NaN and inf times 0 are NaN.) silero-vad adds ``Cast(sr * 0)`` to its state."""
    from kiln.ops import math as M

    if node.op is not M.Mul or len(node.inputs) != 2 or getattr(node.attrs, "broadcast", 0):
        return None
    t = node.outputs[0].type
    if t.dtype is None or not t.dtype.is_int or t.shape is None or not is_static(t.shape):
        return None
    if not any(v is not None and v.const is not None and v.const.size and not v.const.any()
               for v in node.inputs):
        return None
    return [np.zeros(tuple(int(d) for d in t.shape), dtype=t.dtype.np)]


def _inputs_const(node: Node) -> bool:
    return all(v is None or v.const is not None for v in node.inputs)


def _values_from_syms(node: Node) -> list[np.ndarray] | None:
    """The outputs as arrays when the shape rules know every element (all ints)."""
    outs = []
    for v in node.outputs:
        arr = sym_array(v)
        if arr is None:
            return None
        outs.append(arr)
    return outs


def sym_array(v: Value) -> np.ndarray | None:
    """``v``'s contents from its symbolic value, when every element is a known int."""
    t = v.type
    if v.sym is None or not isinstance(t, TensorType) or t.dtype is None or not t.dtype.is_int:
        return None
    if not is_static(t.shape) or not all(_is_int(d) for d in v.sym):
        return None
    if int(np.prod(t.shape)) != len(v.sym):
        return None
    return np.array([int(d) for d in v.sym], dtype=t.dtype.np).reshape(t.shape)


def _is_int(d) -> bool:
    return isinstance(d, (int, np.integer, sympy.Integer))


def _evaluate(graph: Graph, node: Node) -> list[np.ndarray] | None:
    import torch

    from kiln.kernels.torch.convert import to_numpy, to_torch  # torch only when folding

    if _too_big(node):
        return None
    kernels = kernels_for(node.op, "cpu")
    if not kernels:
        return None
    call = Call.of(node, graph.opset)
    args = [None if v is None else to_torch(v.const) for v in node.inputs]
    try:
        with torch.inference_mode():
            out = kernels[0].fn(call, *args)
    except Exception:  # left as a node, it fails at run time with its context
        return None
    outs = out if isinstance(out, tuple) else (out,)
    if len(node.outputs) == 1 and isinstance(out, tuple):
        outs = out[:1]
    arrays = [to_numpy(o) for o in outs]
    if len(arrays) != len(node.outputs) or not all(isinstance(a, np.ndarray) for a in arrays):
        return None  # sequences, optionals: not values a constant can hold
    if sum(a.nbytes for a in arrays) > max(FOLD_CAP, _input_bytes(node)):
        return None
    return [np.array(a, copy=True) for a in arrays]


def _input_bytes(node: Node) -> int:
    return sum(v.const.nbytes for v in node.inputs if v is not None and v.const is not None)


def _too_big(node: Node) -> bool:
    """True when the output types already say the result is over the cap (and bigger than
    the inputs: transposing a large weight is folded, expanding a scalar to 1 GB is not)."""
    total = 0
    for v in node.outputs:
        t = v.type
        if is_static(t.shape) and t.dtype is not None and t.dtype.np.kind != "O":
            total += int(np.prod(t.shape)) * t.dtype.itemsize
    return total > max(FOLD_CAP, _input_bytes(node))


# ---------------------------------------------------------------- shape inputs

# Reshape(x, [batch, -1, 12, 64]) with x: [batch, seq, 768] -> Reshape(x, [0, -1, 12, 64])


def fold_shape_inputs(graph: Graph, log: Callable[[str], None]) -> int:
    """Give Reshape nodes a constant target shape when their output shape allows one."""
    n = 0
    for g in graph_and_subgraphs(graph):
        for node in g.nodes:
            if node.op is not T.Reshape or len(node.inputs) < 2:
                continue
            shape_in = node.inputs[1]
            if shape_in is None or shape_in.const is not None:
                continue
            target = reshape_target(node)
            if target is None:
                continue
            const = Value(g.fresh_name(f"{node.name}/shape"), shape_in.type, const=target)
            const.sym = tuple(int(d) for d in target)
            node.inputs[1] = const
            log(f"folded shape input of {node.name} -> {target.tolist()}")
            n += 1
    return n


def reshape_target(node: Node) -> np.ndarray | None:
    """A constant target for ``node`` (a Reshape) that gives the same output at every size."""
    x, s, y = node.inputs[0], node.inputs[1], node.outputs[0]
    allowzero = bool(getattr(node.attrs, "allowzero", 0) or 0)
    in_shape, out_shape = getattr(x.type, "shape", None), getattr(y.type, "shape", None)
    dims = s.sym
    if dims is None or out_shape is None or len(dims) != len(out_shape):
        return None
    if all(_is_int(d) for d in dims):
        return np.array([int(d) for d in dims], np.int64)
    if allowzero or in_shape is None or None in out_shape:
        return None  # with allowzero a 0 is a literal size, not "copy the input's dim"
    target: list[int | None] = []
    for i, (d, o) in enumerate(zip(dims, out_shape)):
        if _is_int(d):
            target.append(int(d))
        elif i < len(in_shape) and in_shape[i] is not None and same_dim(in_shape[i], o):
            target.append(0)  # 0 copies the input's dim i, which is this output dim
        else:
            target.append(None)
    return _fill_wildcard(target, out_shape)


def _fill_wildcard(target: list, out_shape) -> np.ndarray | None:
    """One still-symbolic dim may become -1 when no -1 is there yet and every other dim is a
    positive int (a 0 there, copied or literal, could make -1 ambiguous on an empty tensor)."""
    open_dims = [i for i, t in enumerate(target) if t is None]
    if len(open_dims) > 1 or (open_dims and -1 in target):
        return None
    if open_dims and not all(t is None or t > 0 for t in target):
        return None
    for i in open_dims:
        target[i] = -1
    if any(t == 0 and _is_int(o) and o == 0 for t, o in zip(target, out_shape)):
        return None
    return np.array(target, np.int64)


def same_dim(a, b) -> bool:
    try:
        return bool(sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0)
    except (sympy.SympifyError, TypeError):
        return False


def graph_and_subgraphs(graph: Graph):
    yield graph
    for n in graph.nodes:
        for g in n.subgraphs():
            yield from graph_and_subgraphs(g)


PASSES = [("fold_constants", fold_constants), ("fold_shape_inputs", fold_shape_inputs)]
