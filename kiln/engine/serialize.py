"""Graph <-> JSON plan + named tensors, for the engine file. No pickle anywhere."""

from __future__ import annotations

import dataclasses

import numpy as np

import kiln.ops  # noqa: F401  (fills the registry)
from kiln.errors import EngineFileError
from kiln.ir import REGISTRY, DType, Graph, Node, OptionalType, SequenceType, TensorType, Value
from kiln.ir.types import dim_from_str


def encode_type(t):
    if isinstance(t, TensorType):
        shape = None if t.shape is None else [
            d if isinstance(d, int) or d is None else str(d) for d in t.shape]
        return {"k": "tensor", "dtype": t.dtype.name if t.dtype else None, "shape": shape}
    if isinstance(t, SequenceType):
        return {"k": "seq", "elem": encode_type(t.elem)}
    if isinstance(t, OptionalType):
        return {"k": "opt", "elem": encode_type(t.elem)}
    return None


def decode_type(d):
    if d is None:
        return None
    if d["k"] == "tensor":
        shape = None if d["shape"] is None else tuple(
            x if isinstance(x, int) or x is None else dim_from_str(x) for x in d["shape"])
        return TensorType(DType[d["dtype"]] if d["dtype"] else None, shape)
    if d["k"] == "seq":
        return SequenceType(decode_type(d["elem"]))
    return OptionalType(decode_type(d["elem"]))


class PlanWriter:
    """Turns a graph into JSON-able dicts, collecting its tensors under unique keys."""

    def __init__(self):
        self.tensors: dict[str, np.ndarray] = {}
        self._choices: dict | None = None  # for the nodes of subgraphs, met through attrs
        self._tactics: dict | None = None

    def tensor(self, arr: np.ndarray):
        arr = np.asarray(arr)
        if arr.dtype == object:
            return {"strings": [str(x) for x in arr.reshape(-1)], "shape": list(arr.shape)}
        key = f"t{len(self.tensors)}"
        self.tensors[key] = arr
        return {"tensor": key}

    def value(self, v: Value) -> dict:
        out = {"name": v.name, "type": encode_type(v.type)}
        if v.sym is not None:
            out["sym"] = [d if isinstance(d, int) or d is None else str(d) for d in v.sym]
        return out

    def attr(self, x):
        if isinstance(x, Graph):
            return {"graph": self.graph(x, self._choices, self._tactics)}
        if isinstance(x, np.ndarray):
            return self.tensor(x)
        if isinstance(x, (TensorType, SequenceType, OptionalType)):
            return {"type": encode_type(x)}
        if isinstance(x, tuple):
            return {"tuple": [self.attr(i) for i in x]}
        if isinstance(x, (np.integer, np.floating)):
            return x.item()
        return x

    def graph(self, g: Graph, choices: dict | None = None,
              tactics: dict | None = None) -> dict:
        """The plan of ``g``; ``choices`` (node name -> kernel name) and ``tactics`` (node
        name -> tactic dict) are written into the node records as ``kernel`` and ``tactic``."""
        self._choices, self._tactics = choices, tactics
        nodes = []
        for n in g.nodes:
            rec = {"op": [n.op.domain, n.op.name], "name": n.name,
                   "inputs": [None if v is None else v.name for v in n.inputs],
                   "outputs": [self.value(v) for v in n.outputs],
                   "attrs": {f.name: self.attr(getattr(n.attrs, f.name))
                             for f in dataclasses.fields(n.attrs)}}
            if choices and n.name in choices:
                rec["kernel"] = choices[n.name]
            if tactics and tactics.get(n.name) is not None:
                rec["tactic"] = dict(tactics[n.name])
            nodes.append(rec)
        weights = [dict(self.value(w), data=self.tensor(w.const)) for w in g.weights.values()]
        consts = [dict(self.value(v), data=self.tensor(v.const)) for v in _node_consts(g)]
        return {"name": g.name, "inputs": [self.value(v) for v in g.inputs],
                "captures": [self.value(v) for v in g.captures], "weights": weights,
                "consts": consts, "nodes": nodes, "outputs": [v.name for v in g.outputs],
                "opset": g.opset, "metadata": g.metadata}


def _node_consts(g: Graph) -> list[Value]:
    known = {id(v) for v in g.weights.values()} | {id(v) for v in g.inputs + g.captures}
    out, seen = [], set()
    for n in g.nodes:
        for v in n.inputs:
            if v is not None and v.const is not None and v.producer is None and \
                    id(v) not in known and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


class PlanReader:
    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors
        self._choices: dict | None = None  # for the nodes of subgraphs, met through attrs
        self._tactics: dict | None = None

    def tensor(self, d):
        if "strings" in d:
            return np.array(d["strings"], dtype=object).reshape(d["shape"])
        return self.tensors[d["tensor"]]

    def value(self, d, const=None) -> Value:
        v = Value(d["name"], decode_type(d["type"]), const=const)
        if "sym" in d:
            v.sym = tuple(x if isinstance(x, int) or x is None else dim_from_str(x)
                          for x in d["sym"])
        return v

    def attr(self, x):
        if isinstance(x, dict):
            if "graph" in x:
                return self.graph(x["graph"], self._choices, self._tactics)
            if "tensor" in x or "strings" in x:
                return self.tensor(x)
            if "type" in x:
                return decode_type(x["type"])
            if "tuple" in x:
                return tuple(self.attr(i) for i in x["tuple"])
        return x

    def graph(self, d: dict, choices: dict | None = None,
              tactics: dict | None = None) -> Graph:
        """The graph of plan ``d``; fills ``choices`` (node name -> kernel name) and
        ``tactics`` (node name -> tactic dict) from the node records, when given."""
        self._choices, self._tactics = choices, tactics
        g = Graph(d["name"])
        g.opset, g.metadata = d.get("opset", {}), d.get("metadata", {})
        scope: dict[str, Value] = {}
        for rec in d["inputs"] + d["captures"]:
            scope[rec["name"]] = self.value(rec)
        g.inputs = [scope[r["name"]] for r in d["inputs"]]
        g.captures = [scope[r["name"]] for r in d["captures"]]
        for rec in d["weights"]:
            v = self.value(rec, const=self.tensor(rec["data"]))
            g.weights[v.name] = scope[v.name] = v
        for rec in d["consts"]:
            scope[rec["name"]] = self.value(rec, const=self.tensor(rec["data"]))
        for rec in d["nodes"]:
            op = REGISTRY.get(*rec["op"])
            if op is None:
                raise EngineFileError(
                    f"node '{rec['name']}' uses op {rec['op'][1]!r} (domain {rec['op'][0]!r}) "
                    "that this kiln does not have; rebuild the engine with this kiln version")
            outs = [self.value(o) for o in rec["outputs"]]
            attrs = op.Attrs(**{k: self.attr(v) for k, v in rec["attrs"].items()})
            ins = [None if i is None else scope[i] for i in rec["inputs"]]
            g.add_node(Node(op, rec["name"], ins, outs, attrs))
            for o in outs:
                scope[o.name] = o
            if choices is not None and "kernel" in rec:
                choices[rec["name"]] = rec["kernel"]
            if tactics is not None and rec.get("tactic") is not None:
                if not isinstance(rec["tactic"], dict):
                    raise TypeError(f"node '{rec['name']}': tactic is not an object")
                tactics[rec["name"]] = dict(rec["tactic"])
        g.outputs = [scope[n] for n in d["outputs"]]
        return g
