"""Elimination: nodes that compute nothing new go away.

- ``remove_noops``: nodes whose output equals their first input (rule table ``pm_noops``).
- ``merge_transposes``: Transpose(Transpose(x, p1), p2) -> Transpose(x, p1[p2]).
- ``merge_reshapes``: Reshape(Reshape(x, s1), s2) -> Reshape(x, s2).
- ``merge_common_nodes``: common subexpressions (same op, inputs and attributes), equal small
  constants, and int vectors the shape rules prove equal (``Value.sym``: Shape(a)[1] and
  Shape(b)[1] are both ``seq``).
- ``remove_dead_nodes``: nodes none of whose outputs reach a graph output, and unused weights.

Graph output names are the engine's output names, so a rewrite never loses one: when the value
a no-op would forward to is an ordinary intermediate, that value takes the output's name;
otherwise (a graph input, a constant, another output) the node stays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.rewrite import is_graph_output, replace_uses
from kiln.ops import quant as Q
from kiln.ops import random as R
from kiln.ops import tensor as T
from kiln.ops import vision as V
from kiln.passes.fold import graph_and_subgraphs, same_dim, sym_array

RANDOM = {R.RandomUniform, R.RandomNormal, R.RandomUniformLike, R.RandomNormalLike,
          R.Bernoulli, R.Multinomial, T.Dropout}
SMALL_CONST = 64 << 10  # bytes; equal constants up to this size are merged by content


# ---------------------------------------------------------------- no-ops


def _same_shape(n: Node) -> bool:
    a, b = getattr(n.inputs[0].type, "shape", None), getattr(n.outputs[0].type, "shape", None)
    if a is None or b is None or len(a) != len(b) or None in a or None in b:
        return False
    return all(same_dim(x, y) for x, y in zip(a, b))


def _const_ints(n: Node, i: int, attr=None) -> list[int] | None:
    """Int contents of input ``i`` (constant or symbolically known), else the attribute."""
    v = n.inputs[i] if i < len(n.inputs) else None
    if v is None:
        return None if attr is None else [int(x) for x in attr]
    arr = v.const if v.const is not None else sym_array(v)
    return None if arr is None else [int(x) for x in np.asarray(arr).reshape(-1)]


def _dropout_is_noop(n: Node) -> bool:
    # inference Dropout passes x through; not when training_mode may be on (an unread mask is
    # checked by the caller)
    if len(n.inputs) > 2 and n.inputs[2] is not None:
        mode = n.inputs[2].const
        return mode is not None and not bool(np.asarray(mode).reshape(-1)[0])
    return True


def _cast_same_dtype(n: Node) -> bool:
    a, b = getattr(n.inputs[0].type, "dtype", None), getattr(n.outputs[0].type, "dtype", None)
    return a is not None and a == b


def _identity_perm(n: Node) -> bool:
    rank = getattr(n.inputs[0].type, "rank", None)
    perm = n.attrs.perm
    if perm is None:
        return rank is not None and rank <= 1  # the default perm reverses the axes
    return list(perm) == list(range(len(perm)))


def _zero_pads(n: Node) -> bool:
    pads = _const_ints(n, 1, n.attrs.pads)
    return pads is not None and not any(pads)


def _full_slice(n: Node) -> bool:
    # steps 1 from 0 and the same length: the slice is the whole tensor
    starts = _const_ints(n, 1, n.attrs.starts)
    steps = _const_ints(n, 4) if len(n.inputs) > 4 and n.inputs[4] is not None else []
    if starts is None or steps is None or any(starts) or any(s != 1 for s in steps):
        return False
    return _same_shape(n)


def _identity_resize(n: Node) -> bool:
    """Resize whose every scale is 1 (given as scales, or as sizes equal to the input's dims
    under the fixed profile) and whose sampling then reads each input position itself: any
    mode (at scale 1 the linear and cubic taps fall on the samples, nearest's source is the
    sample) and any coordinate transform but those that shift it (tf_crop_and_resize's roi;
    tf_half_pixel_for_nn rounding x + 0.5 up). A 320 x 320 image "resized" to 320 x 320
    (torchvision's detection transform) cost 0.59 ms in tv_ssdlite320."""
    if not _same_shape(n):
        return False
    shape = n.inputs[0].type.shape
    rank = len(shape)
    if n.op is V.Upsample or len(n.inputs) == 2:  # (x, scales): asymmetric, nearest floor
        scales = _const_floats(n, 1, getattr(n.attrs, "scales", None))
        sizes = None
        if scales is None and getattr(n.attrs, "height_scale", None) is not None:
            scales = [n.attrs.height_scale, n.attrs.width_scale]  # Upsample-1: H and W
    else:
        coord, nearest = n.attrs.coordinate_transformation_mode, n.attrs.nearest_mode
        scales = _const_floats(n, 2) if len(n.inputs) > 2 and n.inputs[2] is not None else []
        sizes = _const_ints(n, 3) if len(n.inputs) > 3 and n.inputs[3] is not None else []
        if scales is None or sizes is None:
            return False  # a scale or size known only at run time
        if coord == "tf_crop_and_resize" or (coord == "tf_half_pixel_for_nn"
                                             and nearest == "round_prefer_ceil"):
            return False
    axes = getattr(n.attrs, "axes", None)
    axes = [a % rank for a in axes] if axes else list(range(rank))
    if sizes:
        return len(sizes) == len(axes) and all(
            isinstance(shape[a], int) and shape[a] == s for a, s in zip(axes, sizes))
    return bool(scales) and all(s == 1.0 for s in scales)


def _const_floats(n: Node, i: int, attr=None) -> list[float] | None:
    """Float contents of constant input ``i``, else the attribute (None: neither)."""
    v = n.inputs[i] if i < len(n.inputs) else None
    if v is None:
        return None if attr is None else [float(x) for x in attr]
    return None if v.const is None else [float(x) for x in np.asarray(v.const).reshape(-1)]


pm_noops: dict = {
    T.Identity: lambda n: True,  # Identity(x) -> x
    T.Dropout: _dropout_is_noop,  # Dropout(x) -> x at inference (mask unused)
    Q.Cast: _cast_same_dtype,  # Cast(x: T, to=T) -> x
    T.Reshape: _same_shape,  # Reshape(x: S, S) -> x
    T.Transpose: _identity_perm,  # Transpose(x, [0, 1, .., n-1]) -> x
    T.Pad: _zero_pads,  # Pad(x, 0) -> x
    T.Slice: _full_slice,  # Slice(x, 0, end, 1) -> x
    T.Expand: _same_shape,  # Expand(x: S, S) -> x
    V.Resize: _identity_resize,  # Resize(x, scale 1) -> x
    V.Upsample: _identity_resize,  # Upsample(x, scale 1) -> x
}


def remove_noops(graph: Graph, log: Callable[[str], None]) -> int:
    n = 0
    for g in graph_and_subgraphs(graph):
        n += _remove_noops(g, log)
    return n


def _remove_noops(graph: Graph, log) -> int:
    read = _reads(graph)
    gone: set[int] = set()
    for node in graph.nodes:
        rule = pm_noops.get(node.op)
        if rule is None or not node.inputs or node.inputs[0] is None:
            continue
        extra = node.outputs[1:]
        if any(id(v) in read or is_graph_output(graph, v) for v in extra):
            continue  # only Dropout has a second output (its mask), and it is read
        if not rule(node) or not forward(graph, node.outputs[0], node.inputs[0]):
            continue
        gone.add(id(node))
        log(f"removed {node.name} ({node.op.name}: no-op)")
    graph.nodes = [nd for nd in graph.nodes if id(nd) not in gone]
    return len(gone)


def _reads(graph: Graph) -> set[int]:
    return {id(v) for nd in graph.nodes for v in nd.inputs if v is not None}


def forward(graph: Graph, old: Value, new: Value) -> bool:
    """Make every reader of ``old`` read ``new``. If ``old`` is a graph output, ``new`` takes
    its name; that is refused (False) when ``new`` has a name that must not change."""
    if is_graph_output(graph, old):
        if not _renamable(graph, new) or old.type != new.type:
            return False
        new.name = old.name
    replace_uses(graph, old, new)
    return True


def _renamable(graph: Graph, v: Value) -> bool:
    if v.producer is None or v.const is not None or is_graph_output(graph, v):
        return False
    # subgraph owners list captured values by name: leave their names alone
    return not any(nd.subgraphs() and any(i is v for i in nd.inputs) for nd in graph.nodes)


# ---------------------------------------------------------------- chains

# Transpose(Transpose(x, p1), p2) -> Transpose(x, q), q[i] = p1[p2[i]]


def merge_transposes(graph: Graph, log: Callable[[str], None]) -> int:
    n = 0
    for g in graph_and_subgraphs(graph):
        users = g.users()
        for node in g.nodes:
            first = _producer_of(node, T.Transpose)
            if node.op is not T.Transpose or first is None:
                continue
            p1, p2 = _perm(first), _perm(node)
            if p1 is None or p2 is None or len(p1) != len(p2):
                continue
            node.inputs[0] = first.inputs[0]
            node.attrs = dataclasses.replace(node.attrs, perm=tuple(p1[i] for i in p2))
            _merged_name(g, first, node, users, log, "Transpose")
            n += 1
    return n


# Reshape(Reshape(x, s1), s2) -> Reshape(x, s2)  (s2 constant, no 0 that copies a dim of s1)


def merge_reshapes(graph: Graph, log: Callable[[str], None]) -> int:
    n = 0
    for g in graph_and_subgraphs(graph):
        users = g.users()
        for node in g.nodes:
            first = _producer_of(node, T.Reshape)
            if node.op is not T.Reshape or first is None or len(node.inputs) < 2:
                continue
            s2 = _const_ints(node, 1) if node.inputs[1] is not None else None
            if s2 is None or (0 in s2 and not node.attrs.allowzero):
                continue
            node.inputs[0] = first.inputs[0]
            _merged_name(g, first, node, users, log, "Reshape")
            n += 1
    return n


def _producer_of(node: Node, op) -> Node | None:
    x = node.inputs[0] if node.inputs else None
    p = x.producer if x is not None else None
    return p if p is not None and p.op is op and p.inputs and p.inputs[0] is not None else None


def _perm(n: Node) -> list[int] | None:
    if n.attrs.perm is not None:
        return list(n.attrs.perm)
    rank = getattr(n.inputs[0].type, "rank", None)
    return None if rank is None else list(range(rank))[::-1]


def _merged_name(g: Graph, first: Node, second: Node, users, log, what: str) -> None:
    # the first node dies only when this was its one reader; then the pair is one node
    if len(users.get(id(first.outputs[0]), [])) == 1 and \
            not is_graph_output(g, first.outputs[0]):
        second.name = f"{first.name} + {second.name}"
        log(f"fused {second.name} -> {what}")
    else:
        log(f"{second.name} now reads {first.name}'s input ({what} of {what})")


# ---------------------------------------------------------------- common subexpressions


def merge_common_nodes(graph: Graph, log: Callable[[str], None]) -> int:
    n = 0
    for g in graph_and_subgraphs(graph):
        n += _cse(g, log)
    return n


def _cse(graph: Graph, log) -> int:
    subst: dict[int, Value] = {}  # id(value) -> the equal value that replaces it
    seen_nodes: dict = {}
    # a weight that is also a graph input can be overridden at run time: never merged
    seen_values: dict = {("input", id(v)): v for v in graph.inputs + graph.captures}
    merged = 0
    for node in graph.nodes:
        node.inputs = [_subst_const(v, subst, seen_values) for v in node.inputs]
        key = _node_key(node)
        other = seen_nodes.get(key) if key is not None else None
        if other is not None and _outputs_free(graph, node):
            for a, b in zip(node.outputs, other.outputs):
                subst[id(a)] = b
            log(f"merged {node.name} into {other.name} ({node.op.name})")
            merged += 1
            continue
        if key is not None:
            seen_nodes[key] = node
        merged += _merge_by_sym(graph, node, subst, seen_values, log)
    graph.nodes = [nd for nd in graph.nodes if not all(id(o) in subst for o in nd.outputs)]
    return merged


def _subst_const(v: Value | None, subst: dict, seen: dict) -> Value | None:
    if v is None:
        return None
    while id(v) in subst:  # a kept node may itself have been merged by its symbolic value
        v = subst[id(v)]
    c = v.const
    if c is None or c.nbytes > SMALL_CONST or c.dtype == object or ("input", id(v)) in seen:
        return v
    key = ("const", c.dtype.str, c.shape, c.tobytes())
    keep = seen.setdefault(key, v)
    if keep is not v:
        subst[id(v)] = keep
    return keep


def _merge_by_sym(graph: Graph, node: Node, subst: dict, seen: dict, log) -> int:
    """Int vectors with equal symbolic contents are equal at run time: keep the first."""
    if len(node.outputs) != 1:
        return 0
    v, t = node.outputs[0], node.outputs[0].type
    if v.sym is None or None in v.sym or not isinstance(t, TensorType) or \
            is_graph_output(graph, v):
        return 0
    keep = seen.setdefault(("sym", t.dtype, t.shape, tuple(v.sym)), v)
    if keep is v:
        return 0
    subst[id(v)] = keep
    log(f"merged {node.name} into {keep.producer.name} (same value {list(v.sym)})")
    return 1


def _outputs_free(graph: Graph, node: Node) -> bool:
    return not any(is_graph_output(graph, v) for v in node.outputs)


def _node_key(node: Node):
    if node.op in RANDOM or node.subgraphs():
        return None
    ins = tuple(None if v is None else id(v) for v in node.inputs)
    return (node.op, ins, len(node.outputs), _attrs_key(node.attrs))


def _attrs_key(attrs) -> tuple:
    return tuple((f.name, _hashable(getattr(attrs, f.name))) for f in dataclasses.fields(attrs))


def _hashable(x):
    if isinstance(x, np.ndarray):  # compared by value, not identity
        return ("nd", x.dtype.str, x.shape, x.tobytes() if x.dtype != object else repr(x))
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(i) for i in x)
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return x


# ---------------------------------------------------------------- dead nodes


def remove_dead_nodes(graph: Graph, log: Callable[[str], None]) -> int:
    n = _remove_dead(graph, log)
    _remove_unused_weights(graph, log)
    return n


def _remove_dead(graph: Graph, log) -> int:
    live = {id(v) for v in graph.outputs}
    keep: list[Node] = []
    for node in reversed(graph.nodes):
        if not any(id(o) in live for o in node.outputs):
            log(f"removed {node.name} ({node.op.name}: unused)")
            continue
        keep.append(node)
        live.update(id(v) for v in node.inputs if v is not None)
    removed = len(graph.nodes) - len(keep)
    graph.nodes = keep[::-1]
    for node in graph.nodes:
        for g in node.subgraphs():
            removed += _remove_dead(g, log)
    return removed


def _remove_unused_weights(graph: Graph, log) -> None:
    read = _reads(graph) | {id(v) for v in graph.outputs} | {id(v) for v in graph.inputs}
    unused = [k for k, v in graph.weights.items() if id(v) not in read]
    for k in unused:
        del graph.weights[k]
    if unused:
        log(f"dropped {len(unused)} unused weight(s)")


PASSES = [
    ("merge_transposes", merge_transposes),
    ("merge_reshapes", merge_reshapes),
    ("remove_noops", remove_noops),
    ("merge_common_nodes", merge_common_nodes),
    ("remove_dead_nodes", remove_dead_nodes),
]
