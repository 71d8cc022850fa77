"""ONNX ModelProto -> kiln Graph. No per-op code here: everything op-specific is in the OpDefs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, NodeProto, numpy_helper

import kiln.ops  # noqa: F401  (fills the registry)
from kiln.errors import UnsupportedOpsError
from kiln.frontend.functions import expand_function, find_function
from kiln.frontend.infer import infer_node
from kiln.frontend.loader import load_model
from kiln.frontend.specialize import specialize_inputs
from kiln.frontend.typeproto import name_free_dims, type_from_proto
from kiln.ir import REGISTRY, DType, Graph, Node, TensorType, Value

DEFAULT_DOMAINS = ("", "ai.onnx")


def import_onnx(src, base_dir=None, fixed: dict | None = None) -> Graph:
    """Load an ONNX model (path, bytes or ModelProto) and return a typed kiln Graph.

    ``fixed`` (input name -> one int or None per dim, see :func:`fixed_dims`) gives the graph
    inputs those sizes before any shape is inferred: the graph is specialized to them."""
    model = load_model(src, base_dir)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    opset = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    if "" not in opset:
        opset[""] = 1 if model.ir_version < 3 else onnx.defs.onnx_opset_version()
    conv = _Converter(opset, fixed or {})
    graph = conv.graph(model.graph, parent=None)
    if conv.problems:
        raise UnsupportedOpsError(conv.problems)
    graph.opset = opset
    graph.metadata = {p.key: p.value for p in model.metadata_props}
    graph.metadata["producer"] = f"{model.producer_name} {model.producer_version}".strip()
    return graph


class _Scope:
    """Names visible while converting one graph; lookups that reach an outer graph become
    captures of this one."""

    def __init__(self, graph: Graph, parent: _Scope | None):
        self.graph, self.parent, self.names = graph, parent, {}

    def get(self, name: str) -> Value | None:
        if name in self.names:
            return self.names[name]
        if self.parent is None:
            return None
        outer = self.parent.get(name)
        if outer is None:
            return None
        cap = Value(name, outer.type, const=outer.const)
        cap.sym = outer.sym
        self.graph.captures.append(cap)
        self.names[name] = cap
        return cap


class _Converter:
    def __init__(self, opset: dict[str, int], fixed: dict):
        self.opset, self.fixed = opset, fixed
        self.problems: list[str] = []
        self._count = 0
        self._used: set[str] = set()

    def graph(self, gp: GraphProto, parent: _Scope | None) -> Graph:
        g = Graph(gp.name or "main")
        scope = _Scope(g, parent)
        for t in gp.initializer:
            arr = _to_array(t)
            scope.names[t.name] = g.add_weight(t.name, arr, TensorType(DType.from_onnx(
                t.data_type), arr.shape))
        for t in gp.sparse_initializer:
            arr = _sparse_to_array(t)
            scope.names[t.values.name] = g.add_weight(
                t.values.name, arr, TensorType(DType.from_np(arr.dtype), arr.shape))
        for vi in gp.input:
            if vi.name in scope.names:  # an initializer overridable as input: treat as weight
                continue
            t = type_from_proto(vi.type, f"graph input '{vi.name}'")
            v = Value(vi.name, name_free_dims(t, vi.name))
            g.inputs.append(v)
            scope.names[vi.name] = v
        if parent is None and self.fixed:
            specialize_inputs(g.inputs, self.fixed)
        hints = {vi.name: vi.type for vi in gp.value_info}
        hints.update({vi.name: vi.type for vi in gp.output})
        for np_ in gp.node:
            self.node(np_, g, scope, hints)
        for vo in gp.output:
            v = scope.get(vo.name)
            if v is None:
                self.problems.append(f"graph '{g.name}' output '{vo.name}' is produced by no node")
                continue
            if v.type is None or getattr(v.type, "dtype", 1) is None:
                v.type = type_from_proto(vo.type, f"graph output '{vo.name}'") or v.type
            g.outputs.append(v)
        return g

    def node(self, np_: NodeProto, g: Graph, scope: _Scope, hints: dict) -> None:
        domain = "" if np_.domain in DEFAULT_DOMAINS else np_.domain
        op = REGISTRY.get(domain, np_.op_type)
        name = self._unique(np_.name or f"{np_.op_type}_{self._next()}")
        version = self.opset.get(domain, 1)
        if op is None:
            body = find_function(np_, domain, version, self._input_types(np_, scope))
            if body is not None:
                for inner in expand_function(np_, body, name):
                    self.node(inner, g, scope, hints)
                return
            self.problems.append(
                f"node '{name}': op '{np_.op_type}' (domain '{domain or 'ai.onnx'}', "
                f"opset {version}) is not supported")
            for o in np_.output:  # keep later readers from reporting it again
                if o:
                    scope.names[o] = Value(o)
            return
        attrs, subgraphs = {}, []
        for a in np_.attribute:
            if a.ref_attr_name:
                continue
            if a.name not in op.attrs:
                self.problems.append(f"node '{name}': op '{np_.op_type}' has unknown attribute "
                                     f"'{a.name}'")
                continue
            attrs[a.name] = self.attr(a, scope, subgraphs)
        if op.num_outputs_attr:
            attrs["n_out"] = len(np_.output)
        inputs = []
        for i in np_.input:
            v = scope.get(i) if i else None
            if i and v is None:
                self.problems.append(f"node '{name}' reads '{i}', which no node produces and is "
                                     "not a graph input or initializer")
            inputs.append(v)
        inputs += self._capture_inputs(subgraphs, scope)
        outputs = []
        for o in np_.output:
            v = Value(o or g.fresh_name(f"{name}_unused"))
            outputs.append(v)
            if o:
                scope.names[o] = v
        node = g.add_node(Node(op, name, inputs, outputs, op.make_attrs(**attrs)))
        infer_node(node, np_, self.opset, hints)

    def _capture_inputs(self, subgraphs: list[Graph], scope: _Scope) -> list[Value]:
        names: list[str] = []
        for sg in subgraphs:
            for c in sg.captures:
                if c.name not in names:
                    names.append(c.name)
        return [scope.get(n) for n in names]

    def attr(self, a: AttributeProto, scope: _Scope, subgraphs: list):
        t = a.type
        if t == AttributeProto.GRAPH:
            sg = self.graph(a.g, scope)
            subgraphs.append(sg)
            return sg
        if t == AttributeProto.GRAPHS:
            gs = tuple(self.graph(x, scope) for x in a.graphs)
            subgraphs.extend(gs)
            return gs
        if t == AttributeProto.TENSOR:
            return _to_array(a.t)
        if t == AttributeProto.TENSORS:
            return tuple(_to_array(x) for x in a.tensors)
        if t == AttributeProto.SPARSE_TENSOR:
            return _sparse_to_array(a.sparse_tensor)
        if t == AttributeProto.TYPE_PROTO:
            return type_from_proto(a.tp, f"attribute '{a.name}'")
        if t == AttributeProto.STRING:
            return a.s.decode("utf-8", errors="surrogateescape")
        if t == AttributeProto.STRINGS:
            return tuple(s.decode("utf-8", errors="surrogateescape") for s in a.strings)
        if t == AttributeProto.INTS:
            return tuple(int(x) for x in a.ints)
        if t == AttributeProto.FLOATS:
            return tuple(float(x) for x in a.floats)
        if t == AttributeProto.INT:
            return int(a.i)
        if t == AttributeProto.FLOAT:
            return float(a.f)
        return onnx.helper.get_attribute_value(a)

    def _input_types(self, np_: NodeProto, scope: _Scope) -> list:
        return [scope.get(i).type if i and scope.get(i) is not None else None for i in np_.input]

    def _unique(self, name: str) -> str:
        while name in self._used:
            name = f"{name}_{self._next()}"
        self._used.add(name)
        return name

    def _next(self) -> int:
        self._count += 1
        return self._count


def _to_array(t: onnx.TensorProto) -> np.ndarray:
    arr = numpy_helper.to_array(t)
    if arr.dtype == object:
        arr = np.array([x.decode("utf-8", errors="surrogateescape") if isinstance(x, bytes) else x
                        for x in arr.reshape(-1)], dtype=object).reshape(arr.shape)
    return arr


def _sparse_to_array(st: onnx.SparseTensorProto) -> np.ndarray:
    values = _to_array(st.values)
    idx = _to_array(st.indices) if st.HasField("indices") else np.zeros((0,), np.int64)
    dense = np.zeros(tuple(st.dims), dtype=values.dtype)
    if idx.ndim == 1:
        dense.reshape(-1)[idx] = values
    else:
        dense[tuple(idx.T)] = values
    return dense
