"""Where a step runs on a CUDA executor: host or device, decided from its inputs at run time.

The executor keeps small integer constants, and what is computed only from them and from
``Shape``, on the host (see :mod:`kiln.engine.executor`). Everything else belongs on the device:

- a step that reads any device tensor runs its kernel under ``with torch.device(cuda)``, so
  the tensors a PyTorch kernel makes itself (``torch.arange`` index vectors, ``torch.full``
  pad buffers, masks) are made on the device too. Without this, Resize built its gather index
  on the host and Pad returned a host tensor to the device convolution after it;
- a step whose output still lands on the host while it read device data (a kernel that went
  through numpy), or whose host output is not small (a ``ConstantOfShape`` or ``Range`` of a
  host shape), has that output moved to the device and is named in :attr:`Placement.moved`
  (:attr:`Placement.lifted` for the latter), so no host fallback is silent; such a step runs
  under the device context from then on, so its output is made on the device (and a
  CUDA-graph capture after the first run copies nothing from the host);
- the host fallbacks kiln cannot avoid are declared (:func:`host_reason`: ops with no device
  implementation, such as ImageDecoder, and uint64 values, which torch's CUDA kernels lack)
  and named in :attr:`Placement.host` and in the build log (:func:`host_fallbacks`);
- ``Shape`` and ``Size`` read only metadata: their outputs stay on the host whatever they read;
- a float constant that only feeds inputs a kernel reads as Python numbers (Resize's scales,
  Pad's fill value: :data:`HOST_READS`) stays on the host like the integer ones: on the device
  each run would wait for it (``.item()``), and no CUDA graph could be captured.
"""

from __future__ import annotations

import torch

from kiln.ir import DType, TensorType
from kiln.ops import control as C
from kiln.ops import quant as Q
from kiln.ops import signal as S
from kiln.ops import tensor as T
from kiln.ops import text_ml as X
from kiln.ops import vision as V

# ops that read only their inputs' shapes: their (small integer) outputs stay on the host
META_OPS = frozenset({T.Shape, T.Size})
# control flow: outputs are the subgraphs' values, placed by the subgraphs' own executors
CONTROL_OPS = frozenset({C.If, C.Loop, C.Scan})
# input positions read for their dtype or shape alone (CastLike's ``like``)
META_READS = {Q.CastLike: {1}}
HOST_VALUE_MAX = 64  # host outputs up to this many elements computed from host values stay
# input positions the PyTorch kernels read as Python numbers (.item() / .tolist())
HOST_READS = {
    V.Resize: {1, 2, 3}, V.Upsample: {1}, T.Pad: {1, 2, 3}, T.Range: {0, 1, 2},
    T.Dropout: {1, 2}, S.DFT: {1, 2}, S.STFT: {1, 3}, C.If: {0}, C.Loop: {0, 1},
}


# ops whose kernels run on the host whatever they are given, and why
HOST_OPS = {X.ImageDecoder: "decodes the encoded image with PIL on the host",
            T.Unique: "ONNX's first-occurrence order and indices come from numpy's unique"}
_NUMPY = "values of a dtype torch lacks live on the host as numpy arrays"
_HOST_DTYPES = {DType.uint64: "uint64 values: torch's CUDA kernels lack most uint64 ops",
                DType.string: _NUMPY, DType.int4: _NUMPY, DType.uint4: _NUMPY,
                DType.int2: _NUMPY, DType.uint2: _NUMPY, DType.float4e2m1: _NUMPY,
                DType.float6e2m3: _NUMPY, DType.float6e3m2: _NUMPY}


def host_reason(node) -> str | None:
    """Why ``node`` runs on the host on a CUDA engine, or None when it runs on the device."""
    if node.op in HOST_OPS:
        return HOST_OPS[node.op]
    for v in list(node.inputs) + list(node.outputs):
        t = getattr(v, "type", None)
        if isinstance(t, TensorType) and t.dtype in _HOST_DTYPES:
            return _HOST_DTYPES[t.dtype]
    return None


def host_fallbacks(graph) -> dict[str, str]:
    """``node name -> reason`` of every node (subgraphs too) that runs on the host."""
    out = {}
    for n in graph.nodes:
        why = host_reason(n)
        if why is not None:
            out[n.name] = f"{n.op.name}: {why}"
        for g in n.subgraphs():
            out.update(host_fallbacks(g))
    return out


def host_read_slots(steps) -> set[int]:
    """Slots that every reader reads at a :data:`HOST_READS` position."""
    host, other = set(), set()
    for st in steps:
        reads = HOST_READS.get(st.node.op, ())
        for k, s in enumerate(st.ins):
            if s >= 0:
                (host if k in reads else other).add(s)
    return host - other


def on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def reads_device(op, xs) -> bool:
    """Does a step of ``op`` read device data (positions read as numbers, or for their dtype
    alone, do not count)?"""
    skip = HOST_READS.get(op, set()) | META_READS.get(op, set())
    for k, x in enumerate(xs):
        if k in skip:
            continue
        if on_device(x) or (isinstance(x, list) and any(on_device(t) for t in x)):
            return True
    return False


class Placement:
    """Runs steps on ``device``; ``moved`` (node name -> why) lists the steps whose outputs
    came back on the host unexpectedly and were moved up, ``host`` the declared host
    fallbacks (:func:`host_reason`) that ran."""

    def __init__(self, device: torch.device, native: set[int] = frozenset()):
        self.device = device
        self.native = native  # id(step) of Triton-kernel steps: they place their own outputs
        self.moved: dict[str, str] = {}
        self.host: dict[str, str] = {}
        self.lifted: dict[str, str] = {}  # large values made on the host once, then on device
        self._forced: set[int] = set()  # id(step) of steps that run on the device regardless

    def launch(self, st, xs: list):
        """Run ``st``'s kernel on ``xs``: under the device context when it reads device data
        (unless it only reads shapes), then with every host output that must not stay on the
        host moved to the device."""
        op = st.node.op
        dev_in = op not in META_OPS and (id(st) in self._forced or reads_device(op, xs))
        if dev_in and id(st) not in self.native:
            with self.device:
                out = st.fn(st.call, *xs)
        else:
            out = st.fn(st.call, *xs)
        if op in META_OPS or op in CONTROL_OPS:
            return out
        if isinstance(out, tuple):
            return tuple(self._up(st, o, dev_in) for o in out)
        return self._up(st, out, dev_in)

    def _up(self, st, o, dev_in: bool):
        if not isinstance(o, torch.Tensor) or o.device.type != "cpu":
            return o
        declared = host_reason(st.node)
        if declared is not None:
            self.host.setdefault(st.node.name, f"{st.node.op.name}: {declared}")
            return o.to(self.device)
        if dev_in:
            self.moved.setdefault(st.node.name, f"{st.node.op.name}: its kernel returned a "
                                  "host tensor from device inputs")
        elif o.numel() > HOST_VALUE_MAX:
            self.lifted.setdefault(st.node.name, f"{st.node.op.name}: a host value of "
                                   f"{o.numel()} elements computed from host values")
        else:
            return o  # a small host value (shape arithmetic): stays for .tolist() readers
        self._forced.add(id(st))
        return o.to(self.device)
