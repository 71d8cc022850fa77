"""Runs a graph as a flat list of launch records over numbered value slots.

The records are made once; running walks the list, reads each kernel's inputs from slots,
writes its outputs back and clears slots after their last reader, so memory follows lifetimes.

On a CUDA device the weights are copied to the device once, when the executor is made. Small
integer constants (shape vectors, axes, indices) stay on the host, and so does what is computed
from them and from ``Shape``: kernels read those with ``.tolist()``, which would otherwise wait
for the device and make CUDA-graph capture impossible. A kernel that turns out to need one of
them on the device (it fails on mixed devices) is run again with its host inputs copied up, and
the step remembers that (constants are then kept on the device too).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

import kiln.kernels.torch  # noqa: F401  (registers the CPU kernels)
from kiln.engine import chains
from kiln.engine.placement import Placement, host_read_slots
from kiln.engine.step import Step, kernel_error, store_outputs
from kiln.engine.value_flow import shape_setting_inputs, shape_setting_use
from kiln.errors import KilnError
from kiln.ir import Graph, Node
from kiln.kernels.registry import Call, kernels_for
from kiln.kernels.torch.convert import to_torch


def default_choice(node: Node, backend: str):
    ks = kernels_for(node.op, backend) or kernels_for(node.op, "cpu")  # torch runs anywhere
    if not ks:
        raise KilnError(f"node '{node.name}': op {node.op.qualname} has no {backend} kernel")
    return ks[0]


HOST_CONST_MAX = 64  # integer constants up to this many elements stay on the host
# torch.inference_mode() without its Python wrapper (1.6 us a run, against 0.5)
_inference_mode = getattr(torch._C, "_InferenceMode", None)
if _inference_mode is None:  # pragma: no cover  (a torch without it)
    def _inference_mode():
        return torch.inference_mode()
else:
    _inference_mode = functools.partial(_inference_mode, True)


class Executor:
    """Executes ``graph`` with the kernels ``choose(node, backend)`` picks.

    ``tactics`` (node name -> tactic dict, the builder's picks) becomes ``call.tactic`` of each
    node's kernel, subgraph nodes included; nodes without one get None. ``consts_from``: an
    executor of the same graph whose (device) constants this one shares, so kernel variants of
    one engine (one per optimization profile) hold the weights once."""

    def __init__(self, graph: Graph, backend: str = "cpu",
                 choose: Callable = default_choice, opset: dict | None = None,
                 device: torch.device | None = None, tactics: dict | None = None,
                 consts_from: Executor | None = None, fixed_captures: frozenset = frozenset()):
        self.graph, self.backend, self.choose = graph, backend, choose
        # captures whose outer values are constants: the same values every run
        self.fixed_captures = fixed_captures
        # where input values may set a shape or branch (the native program is then planned per
        # value of those inputs)
        self.program_blocked: str | None = None
        self.tactics = tactics or {}
        self.device = device if device is not None and device.type != "cpu" else None
        self.opset = dict(opset or {}, **graph.opset)
        slot: dict[int, int] = {}

        def slot_of(v) -> int:
            if id(v) not in slot:
                slot[id(v)] = len(slot)
            return slot[id(v)]

        self._native: set[int] = set()  # id(step) of steps whose kernel is not PyTorch's
        self.input_slots = [slot_of(v) for v in graph.inputs + graph.captures]
        self.consts = [(slot_of(v), to_torch(v.const)) for v in graph.weights.values()]
        for n in graph.nodes:  # folded constants that live on node-less values
            for v in n.inputs:
                if v is not None and v.const is not None and id(v) not in slot:
                    self.consts.append((slot_of(v), to_torch(v.const)))
        self.steps = [self._step(n, slot_of) for n in graph.nodes]
        self.output_slots = [slot_of(v) for v in graph.outputs]
        self.n_slots = len(slot)
        self.const_slots = {s for s, _ in self.consts}
        _plan_frees(self.steps, self.output_slots, self.const_slots)
        # what run() walks: on the CPU, runs of steps kiln's C library can take become native
        # chains (kiln.engine.chains); timed (profiling) runs walk the steps one by one
        self.run_steps = self.steps
        if backend == "cpu" and self.device is None and chains.enabled():
            self.run_steps = chains.chain_steps(self.steps, self.output_slots,
                                                self.const_slots, dict(self.consts))
            if len(self.run_steps) != len(self.steps):
                _plan_frees(self.run_steps, self.output_slots, self.const_slots)
        self.program = _native_program(self)
        self._device_consts: dict[int, torch.Tensor] = {}  # host constants a kernel needed up
        # CUDA: which steps run under the device context, and host outputs moved up
        self.placement = (Placement(self.device, self._native) if self.device is not None
                          else None)
        if consts_from is not None:
            if consts_from.graph is not graph or consts_from.n_slots != self.n_slots:
                raise ValueError("consts_from must be an executor of the same graph")
            self.consts = list(consts_from.consts)
            self._device_consts = consts_from._device_consts
        elif self.device is not None:
            host_reads = host_read_slots(self.steps)
            self.consts = [(s, _place(c, self.device, s in host_reads)) for s, c in self.consts]
            _conv_weights_channels_last(self)

    @property
    def device_weight_bytes(self) -> int:
        """Bytes of constants resident on the device."""
        return sum(c.numel() * c.element_size() for _, c in self.consts + list(
            self._device_consts.items()) if isinstance(c, torch.Tensor) and c.device.type != "cpu")

    def _step(self, node: Node, slot_of) -> Step:
        kernel = self.choose(node, self.backend)
        subgraphs = node.subgraphs()
        n_caps = len({c.name for g in subgraphs for c in g.captures})
        call = Call.of(node, self.opset, n_caps, tactic=self.tactics.get(node.name))
        if subgraphs:
            call.run_graph = _SubgraphRunner(node, subgraphs, n_caps, self.backend, self.choose,
                                             self.opset, self.device, self.tactics)
        ins = tuple(-1 if v is None else slot_of(v) for v in node.inputs)
        outs = tuple(slot_of(v) for v in node.outputs)
        st = Step(kernel.fn, call, ins, outs, (), node)
        if kernel.backend != "cpu":
            self._native.add(id(st))
        return st

    def run(self, args: list, timer=None, keep: list | None = None) -> list:
        """Run once. ``timer(step_index, seconds)``, when given, receives every step's time
        (a profiling run: slower, as each step is synchronised). ``keep`` (CUDA-graph capture)
        collects host buffers the captured copies read, which must outlive the graph."""
        if timer is not None:
            return self._run_timed(args, timer)
        if self.program is not None:
            with _inference_mode():
                outs = self.program.run(args, self._trace_call)
            if outs is not None:
                return outs
        env = self._env(args)
        with torch.inference_mode():
            for st in self.run_steps:
                store_outputs(st, env, self._call(st, env, keep))
                for s in st.free:
                    env[s] = None
        return [env[s] for s in self.output_slots]

    def _trace_call(self, st: Step, xs: list):
        try:
            return st.fn(st.call, *xs)
        except KilnError:
            raise
        except Exception as e:
            raise kernel_error(st, e) from e

    def _env(self, args: list) -> list:
        env: list = [None] * self.n_slots
        for s, v in zip(self.input_slots, args):
            env[s] = v
        for s, c in self.consts:
            env[s] = c
        return env

    def _call(self, st: Step, env: list, keep: list | None):
        xs = [env[i] if i >= 0 else None for i in st.ins]
        if st.upload:
            xs = self._upload(st, xs, keep)
        try:
            return self._launch(st, xs)
        except KilnError:
            raise
        except Exception as e:
            if self.device is None or not _mixed_devices(xs):
                raise kernel_error(st, e) from e
            first = e
        st.upload = tuple(k for k, x in enumerate(xs) if _on_host(x))
        try:
            return self._launch(st, self._upload(st, xs, keep))
        except KilnError:
            raise
        except Exception as e:  # not the devices after all: report the kernel's own error
            st.upload = ()
            raise kernel_error(st, first) from e

    def _launch(self, st: Step, xs: list):
        if self.placement is None:
            return st.fn(st.call, *xs)
        return self.placement.launch(st, xs)

    def _upload(self, st: Step, xs: list, keep: list | None) -> list:
        xs = list(xs)
        for k in st.upload:
            x, slot = xs[k], st.ins[k]
            if not _on_host(x):
                continue
            if slot in self.const_slots:
                up = self._device_consts.get(slot)
                if up is None and keep is None:  # made outside any capture, kept for good
                    up = self._device_consts[slot] = x.to(self.device)
                if up is not None:
                    xs[k] = up
                    continue
            if keep is not None:  # capture: a pinned source the replayed copy can read
                pinned = x.pin_memory()
                keep.append(pinned)
                xs[k] = pinned.to(self.device, non_blocking=True)
            else:
                xs[k] = x.to(self.device)
        return xs

    def _run_timed(self, args: list, timer) -> list:
        import time

        sync = torch.cuda.synchronize if self.device is not None else (lambda: None)
        env = self._env(args)
        with torch.inference_mode():
            for k, st in enumerate(self.steps):
                sync()
                t0 = time.perf_counter()
                out = self._call(st, env, None)
                sync()
                timer(k, time.perf_counter() - t0)
                store_outputs(st, env, out)
        return [env[s] for s in self.output_slots]


def _native_program(ex: Executor):
    """The executor's steps as one native program (kiln.engine.program), on the CPU where
    kiln's C library is built; None elsewhere."""
    from kiln import native
    from kiln.settings import SETTINGS

    if ex.backend != "cpu" or ex.device is not None or not native.available \
            or not SETTINGS.cpu_program:
        return None
    # a program is planned per input signature, not per value: it is kept from those whose
    # integer or bool inputs could set a shape or a branch by their values (a Reshape shape,
    # Slice bounds, an If condition), which the plan would silently keep; ids gathered from a
    # table and masks feeding arithmetic do not (kiln.engine.value_flow)
    # (where they do, the program is planned per value of those inputs: ``keyed``)
    ex.program_blocked = shape_setting_use(ex.graph, ex.fixed_captures)
    keyed = ()
    if ex.program_blocked is not None:
        names = shape_setting_inputs(ex.graph, ex.fixed_captures)
        if shape_setting_use(ex.graph, ex.fixed_captures | frozenset(names)) is not None:
            return None  # set by what a plan per value does not key on (a float cast to ints)
        keyed = tuple(k for k, v in enumerate(ex.graph.inputs + ex.graph.captures)
                      if v.name in names)
    from kiln.engine.program import Program

    # the steps before chaining: the program has records for what chains hold (GEMMs,
    # LayerNorms, attention), and a chain in it would be a torch record; where a signature
    # gets no plan, the executor runs run_steps, chains included
    return Program(ex.steps, ex.input_slots, dict(ex.consts), ex.output_slots, keyed)


def _plan_frees(steps: list, output_slots: list, const_slots: set) -> None:
    """Each step's ``free``: the slots whose last reader or writer it is (not outputs or
    constants)."""
    keep = set(output_slots) | const_slots
    last: dict[int, int] = {}
    for i, st in enumerate(steps):
        for s in st.ins + st.outs:
            if s >= 0:
                last[s] = i
    frees: dict[int, list[int]] = {}
    for s, i in last.items():
        if s not in keep:
            frees.setdefault(i, []).append(s)
    for i, st in enumerate(steps):
        st.free = tuple(frees.get(i, ()))


def _on_host(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


def _mixed_devices(xs: list) -> bool:
    """Did host and device tensors meet in a kernel's inputs? (Then its failure may be theirs:
    torch words it many ways — "device", "index is on cpu", "Input type (torch.HalfTensor)
    and weight type (torch.cuda.HalfTensor)" — so any failure is retried with them up.)"""
    return len({x.device.type for x in xs if isinstance(x, torch.Tensor)}) > 1


def _place(c, device: torch.device, host_read: bool = False):
    """A constant's home on a CUDA executor: small integer tensors stay on the host, and so do
    small ones of any dtype that kernels only read as numbers (``host_read``)."""
    if not isinstance(c, torch.Tensor):
        return c  # dtypes torch lacks (strings) stay numpy
    integer = not c.dtype.is_floating_point and not c.dtype.is_complex
    if (integer or host_read) and c.numel() <= HOST_CONST_MAX:
        return c
    return c.to(device)


def _conv_weights_channels_last(ex: Executor) -> None:
    """Store the 4-D FP16/BF16 weights of FusedConv steps channels_last, in place of their NCHW
    upload: the CUDA conv kernels run channels-last and keep a converted copy of an NCHW weight
    in the node's cache, which would put every conv weight on the device twice. Only weights
    that nothing else reads (another node or input position, a graph output) are converted;
    channels_last is a memory format, the same logical tensor, but kernels that index a raw
    pointer as contiguous would misread it."""
    from kiln.ops import fused_conv as FC

    uses: dict[int, set[bool]] = {}
    for st in ex.steps:
        for k, s in enumerate(st.ins):
            if s >= 0:
                uses.setdefault(s, set()).add(st.node.op is FC.FusedConv and k == 1)
    outputs = set(ex.output_slots)
    for i, (s, c) in enumerate(ex.consts):
        if (uses.get(s) == {True} and s not in outputs and isinstance(c, torch.Tensor)
                and c.dim() == 4 and c.dtype in (torch.float16, torch.bfloat16)):
            # replaced one by one: each NCHW copy is freed before the next is converted
            ex.consts[i] = (s, c.contiguous(memory_format=torch.channels_last))


class _SubgraphRunner:
    """``call.run_graph(graph, args, captured)``: runs one of the node's subgraphs, handing it
    the captured outer values it reads."""

    def __init__(self, node: Node, subgraphs: list[Graph], n_caps: int, backend, choose,
                 opset: dict, device: torch.device | None = None, tactics: dict | None = None):
        # the frontend appended the captured outer values to the node's inputs, in order
        self.n_caps = n_caps  # the node's last n_caps inputs are the captured values
        names = [v.name for v in node.inputs[len(node.inputs) - n_caps:]] if n_caps else []
        self.index = {id(g): [names.index(c.name) for c in g.captures] for g in subgraphs}
        fixed = frozenset(v.name for v in node.inputs[len(node.inputs) - n_caps:]
                          if n_caps and v is not None and v.const is not None)
        self.execs = {id(g): Executor(g, backend, choose, opset, device, tactics,
                                      fixed_captures=fixed)
                      for g in subgraphs}

    def __call__(self, graph: Graph, args: list, captured) -> list:
        caps = [captured[i] for i in self.index[id(graph)]]
        return self.execs[id(graph)].run(list(args) + caps)
