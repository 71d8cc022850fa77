"""Triton pointwise chains: a chain of elementwise ops becomes ONE generated Triton kernel.

A chain is a :class:`Program`. ``FusedPointwise``'s ``program`` attribute is a JSON list of
steps ``[op name, [refs]]`` ("iN" the node's input N, "sN" step N's result; the last step is the
output). The generator also reads a richer dict form, with attributes, literal constants and
several outputs::

    {"inputs": 2,
     "ops": [{"op": "Add", "in": ["i0", "i1"]},
             {"op": "Gelu", "in": ["t0"], "attrs": {"approximate": "tanh"}},
             {"op": "Mul", "in": ["t1", 0.5]}],
     "outputs": ["t2"]}

Every value is computed in fp32 (booleans as int1) and rounded to its dtype only where a Cast
says so and at the store. Inputs broadcast to the output shape through their strides: a full
contiguous input is read at the flat index, a per-channel or last-dim constant at an index
computed from the dims it varies over, a one-element input once. Kernels are compiled once per
signature (program, input broadcast patterns, dtypes): the source is written to a module file
(Triton's JIT reads function source) and cached in-process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.ir import DType
from kiln.kernels.registry import register
from kiln.kernels.torch import fused_transformer as torch_ft
from kiln.kernels.torch.convert import TORCH_DTYPE
from kiln.kernels.triton.common import FLOATS, launch, on_device, tactic_of
from kiln.kernels.triton.lazy import cdiv
from kiln.ops import fused_transformer as FT
from kiln.ops.rules import broadcast_ints


@dataclass(frozen=True)
class Instr:
    op: str
    args: tuple  # "iK" | "tJ" | float
    attrs: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Program:
    n_inputs: int
    ops: tuple[Instr, ...]
    outputs: tuple[str, ...]

    @classmethod
    def from_json(cls, text: str | dict | list, n_inputs: int | None = None) -> Program:
        d = json.loads(text) if isinstance(text, str) else text
        if isinstance(d, list):  # FusedPointwise: [[op, [refs]], ...], the last step out
            ops = tuple(Instr(name, tuple(_ref(r) for r in refs)) for name, refs in d)
            used = [int(r[1:]) + 1 for i in ops for r in i.args if r.startswith("i")]
            return cls(n_inputs if n_inputs is not None else max(used, default=0), ops,
                       (f"t{len(ops) - 1}",))
        ops = tuple(Instr(o["op"], tuple(_ref(r) for r in o["in"]), dict(o.get("attrs") or {}))
                    for o in d["ops"])
        return cls(int(d["inputs"]), ops, tuple(_ref(r) for r in d["outputs"]))

    def to_json(self) -> str:
        return json.dumps({"inputs": self.n_inputs, "outputs": list(self.outputs),
                           "ops": [{"op": i.op, "in": list(i.args), "attrs": i.attrs}
                                   for i in self.ops]}, sort_keys=True)


def _ref(r):
    """"iN" / "tN" (or FusedPointwise's "sN") stay names; anything else is a literal number."""
    if isinstance(r, str) and r[:1] in "its" and r[1:].isdigit():
        return "t" + r[1:] if r[0] == "s" else r
    return float(r)


# ---------------------------------------------------------------- op table

_BOOL_OUT = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
             "Xor", "IsNaN"}


def _pow(a, attrs):
    x, y = a
    const = {2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})", 1.0: x, 0.5: f"tl.sqrt({x})",
             -1.0: f"(1.0 / {x})", -0.5: f"(1.0 / tl.sqrt({x}))"}
    try:
        return const[float(y)]
    except (KeyError, ValueError):
        return f"pow_({x}, {y})"


def _gelu(a, attrs):
    return f"gelu_tanh({a[0]})" if attrs.get("approximate") == "tanh" else f"gelu({a[0]})"


def _clip(a, attrs):
    x, lo, hi = (list(a) + [None, None])[:3]
    lo = lo if lo is not None else attrs.get("min")
    hi = hi if hi is not None else attrs.get("max")
    if lo is not None:
        x = f"tl.maximum({x}, {lo})"
    return f"tl.minimum({x}, {hi})" if hi is not None else x


def _fold(fn):
    def gen(a, attrs):
        out = a[0]
        for b in a[1:]:
            out = f"{fn}({out}, {b})"
        return out
    return gen


# op -> (args, attrs) -> Triton expression; arguments are fp32 (or int1 for booleans)
_GEN = {
    "Identity": lambda a, t: a[0],
    "Add": lambda a, t: f"({a[0]} + {a[1]})",
    "Sub": lambda a, t: f"({a[0]} - {a[1]})",
    "Mul": lambda a, t: f"({a[0]} * {a[1]})",
    "Div": lambda a, t: f"({a[0]} / {a[1]})",
    "Pow": _pow,
    "Neg": lambda a, t: f"(-{a[0]})",
    "Abs": lambda a, t: f"tl.abs({a[0]})",
    "Reciprocal": lambda a, t: f"(1.0 / {a[0]})",
    "Sqrt": lambda a, t: f"tl.sqrt({a[0]})",
    "Exp": lambda a, t: f"tl.exp({a[0]})",
    "Log": lambda a, t: f"tl.log({a[0]})",
    "Sin": lambda a, t: f"tl.sin({a[0]})",
    "Cos": lambda a, t: f"tl.cos({a[0]})",
    "Floor": lambda a, t: f"tl.floor({a[0]})",
    "Ceil": lambda a, t: f"tl.ceil({a[0]})",
    "Erf": lambda a, t: f"tl.erf({a[0]})",
    "Relu": lambda a, t: f"tl.maximum({a[0]}, 0.0)",
    "Sigmoid": lambda a, t: f"sigmoid({a[0]})",
    "Tanh": lambda a, t: f"tanh({a[0]})",
    "Gelu": _gelu,
    "LeakyRelu": lambda a, t: f"tl.where({a[0]} >= 0, {a[0]}, {a[0]} * {t.get('alpha', 0.01)})",
    "HardSigmoid": lambda a, t: (f"tl.minimum(tl.maximum({t.get('alpha', 0.2)} * {a[0]} + "
                                 f"{t.get('beta', 0.5)}, 0.0), 1.0)"),
    "HardSwish": lambda a, t: f"({a[0]} * tl.minimum(tl.maximum({a[0]} / 6.0 + 0.5, 0.0), 1.0))",
    "Softplus": lambda a, t: f"tl.log(1.0 + tl.exp({a[0]}))",
    "Clip": _clip,
    "Max": _fold("tl.maximum"),
    "Min": _fold("tl.minimum"),
    "Where": lambda a, t: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    "Equal": lambda a, t: f"({a[0]} == {a[1]})",
    "Less": lambda a, t: f"({a[0]} < {a[1]})",
    "Greater": lambda a, t: f"({a[0]} > {a[1]})",
    "LessOrEqual": lambda a, t: f"({a[0]} <= {a[1]})",
    "GreaterOrEqual": lambda a, t: f"({a[0]} >= {a[1]})",
    "Not": lambda a, t: f"({a[0]} == 0)",
    "And": lambda a, t: f"({a[0]} & {a[1]})",
    "Or": lambda a, t: f"({a[0]} | {a[1]})",
    "Xor": lambda a, t: f"({a[0]} ^ {a[1]})",
    "IsNaN": lambda a, t: f"({a[0]} != {a[0]})",
}

_CAST_TL = {DType.float32: None, DType.float16: "tl.float16", DType.bfloat16: "tl.bfloat16",
            DType.bool: "bool"}


def _cast(arg: str, is_bool: bool, to: int) -> tuple[str, bool]:
    """Cast keeps values in fp32 registers but rounds them as the target dtype would."""
    target = _CAST_TL[DType(int(to))]
    if target == "bool":
        return (arg, True) if is_bool else (f"({arg} != 0)", True)
    if is_bool:
        return f"{arg}.to(tl.float32)", False
    return (arg if target is None else f"{arg}.to({target}).to(tl.float32)"), False


def check(program: Program) -> str | None:
    """Why ``program`` cannot be generated, or None when it can."""
    for i in program.ops:
        if i.op == "Cast":
            if DType(int(i.attrs.get("to", 0))) not in _CAST_TL:
                return f"Cast to {DType(int(i.attrs.get('to', 0))).name}"
        elif i.op not in _GEN:
            return f"op {i.op}"
    return None


# ---------------------------------------------------------------- code generation


def _literal(x) -> str:
    x = float(x)
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else '(-float("inf"))'
    return repr(x)


def _load(k: int, kind, rank: int) -> str:
    if kind == "s":
        return f"tl.load(P{k})"
    if kind == "f":
        return f"tl.load(P{k} + idx, mask=mask, other=0)"
    off = " + ".join(f"((idx // I{d}) % D{d}) * S{k}_{d}" for d in range(rank) if kind[d])
    return f"tl.load(P{k} + ({off or '0'}), mask=mask, other=0)"


def generate(program: Program, kinds: tuple, in_bool: tuple, rank: int) -> str:
    """Triton source of the kernel for ``program`` with input broadcast ``kinds`` ("f" full,
    "s" one element, or a tuple of bools: the output dims the input varies over)."""
    params = [f"P{k}" for k in range(program.n_inputs)]
    params += [f"O{j}" for j in range(len(program.outputs))]
    params += ["numel"] + [f"D{d}" for d in range(rank)] + [f"I{d}" for d in range(rank)]
    for k, kind in enumerate(kinds):
        if isinstance(kind, tuple):
            params += [f"S{k}_{d}" for d in range(rank) if kind[d]]
    body = ["idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
            "mask = idx < numel"]
    is_bool: dict[str, bool] = {}
    used = {a for i in program.ops for a in i.args if isinstance(a, str)} | set(program.outputs)
    for k in range(program.n_inputs):
        if f"i{k}" in used:
            conv = "" if in_bool[k] else ".to(tl.float32)"
            body.append(f"i{k} = {_load(k, kinds[k], rank)}{conv}")
        is_bool[f"i{k}"] = in_bool[k]

    def ref(a):
        return a if isinstance(a, str) else _literal(a)

    for j, ins in enumerate(program.ops):
        args = [ref(a) for a in ins.args]
        if ins.op == "Cast":
            expr, b = _cast(args[0], is_bool[ins.args[0]], ins.attrs.get("to"))
        else:
            expr, b = _GEN[ins.op](args, ins.attrs), ins.op in _BOOL_OUT
            if ins.op == "Where":
                b = all(is_bool.get(a, False) for a in ins.args[1:])
        is_bool[f"t{j}"] = b
        body.append(f"t{j} = {expr}")
    for j, o in enumerate(program.outputs):
        body.append(f"tl.store(O{j} + idx, {o}.to(O{j}.dtype.element_ty), mask=mask)")
    return "\n".join([
        "from __future__ import annotations", "",
        "from kiln.kernels.triton.common import gelu, gelu_tanh, pow_, sigmoid, tanh  # noqa",
        "from kiln.kernels.triton.lazy import jit, tl", "", "", "@jit",
        f"def pointwise_kernel({', '.join(params)}, BLOCK: tl.constexpr):",
        *("    " + line for line in body), ""])


_COMPILED: dict[str, object] = {}  # source hash -> kernel
_BY_SIGNATURE: dict[tuple, object] = {}  # (program, kinds, in_bool, rank) -> kernel
_SRC_DIR = Path(tempfile.gettempdir()) / "kiln_triton_pointwise"


def compile_source(src: str):
    """The ``@jit`` kernel in ``src``, loaded once per distinct source."""
    key = hashlib.sha256(src.encode()).hexdigest()[:24]
    if key not in _COMPILED:
        _SRC_DIR.mkdir(parents=True, exist_ok=True)
        path = _SRC_DIR / f"pw_{key}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{id(src)}.tmp")
            tmp.write_text(src)
            tmp.replace(path)
        spec = importlib.util.spec_from_file_location(f"kiln_pw_{key}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _COMPILED[key] = mod.pointwise_kernel
    return _COMPILED[key]


# ---------------------------------------------------------------- launching


def _classify(t: torch.Tensor, shape: tuple) -> tuple:
    """("f"|"s"|dims mask, strides): how input ``t`` is read at the output's flat index."""
    if t.numel() == 1:
        return "s", ()
    strides = t.expand(shape).stride()  # 0 on the dims t is broadcast over
    mask = tuple(s != 0 and n > 1 for s, n in zip(strides, shape))
    dense = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    if all(m and s == c for m, s, c, n in zip(mask, strides, dense, shape) if n > 1):
        return "f", ()
    return mask, tuple(s for s, m in zip(strides, mask) if m)


def run(program: Program, inputs: list, out_dtypes: list, tactic: dict | None = None):
    """Run ``program`` on torch tensors with one generated kernel; returns the outputs."""
    shape = broadcast_ints(*(t.shape for t in inputs))
    rank = len(shape)
    classes = [_classify(t, shape) for t in inputs]
    kinds = tuple(c[0] for c in classes)
    in_bool = tuple(t.dtype == torch.bool for t in inputs)
    key = (program, kinds, in_bool, rank)
    kernel = _BY_SIGNATURE.get(key)
    if kernel is None:
        kernel = _BY_SIGNATURE[key] = compile_source(generate(program, kinds, in_bool, rank))
    device = inputs[0].device
    outs = [torch.empty(shape, dtype=dt, device=device) for dt in out_dtypes]
    numel = math.prod(shape)
    inner = [math.prod(shape[d + 1:]) for d in range(rank)]
    strides = [s for _, st in classes for s in st]
    t = dict({"BLOCK": 1024, "num_warps": 4}, **(tactic or {}))
    if numel:
        grid = (cdiv(numel, t["BLOCK"]),)
        launch(kernel, grid, *inputs, *outs, numel, *shape, *inner, *strides, BLOCK=t["BLOCK"],
               num_warps=t["num_warps"])
    return outs


_EAGER = {
    "Identity": lambda a, t: a[0], "Add": lambda a, t: a[0] + a[1],
    "Sub": lambda a, t: a[0] - a[1], "Mul": lambda a, t: a[0] * a[1],
    "Div": lambda a, t: a[0] / a[1], "Pow": lambda a, t: torch.pow(a[0], a[1]),
    "Neg": lambda a, t: -a[0], "Abs": lambda a, t: a[0].abs(),
    "Reciprocal": lambda a, t: 1.0 / a[0], "Sqrt": lambda a, t: a[0].sqrt(),
    "Exp": lambda a, t: a[0].exp(), "Log": lambda a, t: a[0].log(),
    "Sin": lambda a, t: a[0].sin(), "Cos": lambda a, t: a[0].cos(),
    "Floor": lambda a, t: a[0].floor(), "Ceil": lambda a, t: a[0].ceil(),
    "Erf": lambda a, t: torch.erf(a[0]), "Relu": lambda a, t: a[0].relu(),
    "Sigmoid": lambda a, t: a[0].sigmoid(), "Tanh": lambda a, t: a[0].tanh(),
    "Gelu": lambda a, t: F.gelu(a[0], approximate=t.get("approximate", "none")),
    "LeakyRelu": lambda a, t: F.leaky_relu(a[0], t.get("alpha", 0.01)),
    "HardSigmoid": lambda a, t: (t.get("alpha", 0.2) * a[0] + t.get("beta", 0.5)).clamp(0, 1),
    "HardSwish": lambda a, t: F.hardswish(a[0]), "Softplus": lambda a, t: F.softplus(a[0]),
    "Max": lambda a, t: _reduce(torch.maximum, a), "Min": lambda a, t: _reduce(torch.minimum, a),
    "Where": lambda a, t: torch.where(a[0], a[1], a[2]),
    "Equal": lambda a, t: a[0] == a[1], "Less": lambda a, t: a[0] < a[1],
    "Greater": lambda a, t: a[0] > a[1], "LessOrEqual": lambda a, t: a[0] <= a[1],
    "GreaterOrEqual": lambda a, t: a[0] >= a[1], "Not": lambda a, t: ~a[0],
    "And": lambda a, t: a[0] & a[1], "Or": lambda a, t: a[0] | a[1],
    "Xor": lambda a, t: a[0] ^ a[1], "IsNaN": lambda a, t: a[0].isnan(),
}


def _reduce(fn, a):
    out = a[0]
    for b in a[1:]:
        out = fn(out, b)
    return out


def _eager_clip(a, t):
    x, lo, hi = (list(a) + [None, None])[:3]
    lo = lo if lo is not None else t.get("min")
    hi = hi if hi is not None else t.get("max")
    return x.clamp(min=lo, max=hi)


_EAGER["Clip"] = _eager_clip


def run_eager(program: Program, inputs: list, out_dtypes: list):
    """The same chain with PyTorch ops, fp32 in between (fallback and test oracle)."""
    env = {f"i{k}": (t if t.dtype == torch.bool else t.float()) for k, t in enumerate(inputs)}
    for j, ins in enumerate(program.ops):
        args = [env[a] if isinstance(a, str) else torch.tensor(float(a)) for a in ins.args]
        args = [a.to(inputs[0].device) for a in args]
        if ins.op == "Cast":
            to = TORCH_DTYPE[DType(int(ins.attrs["to"]))]
            y = args[0].to(to)
            env[f"t{j}"] = y if to == torch.bool else y.float()
        else:
            env[f"t{j}"] = _EAGER[ins.op](args, ins.attrs)
    return [env[o].to(dt) for o, dt in zip(program.outputs, out_dtypes)]


# ---------------------------------------------------------------- the FusedPointwise kernel


def _program(n) -> Program:
    if "pw_program" not in n.cache:
        n.cache["pw_program"] = Program.from_json(n.a.program, n.n_in)
    return n.cache["pw_program"]


def _out_dtypes(n, inputs) -> list:
    """The node's output dtypes (the executor fills ``out_types``), else the input's."""
    dts = [TORCH_DTYPE.get(getattr(t, "dtype", None)) for t in n.out_types]
    return dts if dts and None not in dts else [inputs[0].dtype]


def supports(n, inputs) -> bool:
    try:
        p = _program(n)
    except (KeyError, TypeError, ValueError, IndexError):
        return False
    if check(p) is not None or len(inputs) != p.n_inputs or not inputs:
        return False
    if not all(isinstance(t, torch.Tensor) for t in inputs) or not on_device(*inputs):
        return False
    if any(t.dtype not in (*FLOATS, torch.bool) for t in inputs):
        return False
    if any(dt not in (*FLOATS, torch.bool) for dt in _out_dtypes(n, inputs)):
        return False
    try:  # not torch.broadcast_shapes: its first call imports torch's symbolic shapes
        # (0.17 s of a fresh process's first run, measured on the H200 for BERT-base)
        broadcast_ints(*(t.shape for t in inputs))
    except ValueError:
        return False
    return True


TACTICS = tuple({"BLOCK": b, "num_warps": w}
                for b, w in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8)))


@register(FT.FusedPointwise, backend="cuda", name="TritonPointwise", tactics=TACTICS,
          supports=supports)
def fused_pointwise(n, *inputs):
    if not supports(n, inputs):
        return torch_ft.fused_pointwise(n, *inputs)
    outs = run(_program(n), list(inputs), _out_dtypes(n, inputs), tactic_of(n, {}))
    return tuple(outs) if len(outs) > 1 else outs[0]
