"""Layout (CPU): run 2-D float32 convolutions channels-last with weights packed once.

oneDNN's fastest fp32 convolutions read and write NHWC activations; PyTorch's NCHW path
reorders around every call. A FusedConv marked ``layout="nhwc"`` runs as one oneDNN primitive
(``torch.ops.mkldnn._convolution_pointwise``) on a channels-last input, writes a channels-last
output, and keeps its weight reordered in the node's cache after the first run. Consecutive
convolutions then pass NHWC tensors along with no reorders between them (pointwise ops, pooling
and the residual adds keep the memory format), and the engine file still stores the weights as
plain NCHW arrays.

    Conv(x, W, b)                     ==>  FusedConv(x, W, b, layout="nhwc")   (same name)
    FusedConv(x, W, b, act, r)        ==>  FusedConv(x, W, b, act, r, layout="nhwc")

Only for 4-D inputs with a constant float32 4-D weight; anything else keeps PyTorch's path.
"""

from __future__ import annotations

from kiln.ir import DType, Graph, Node
from kiln.ops import fused_conv as FC
from kiln.ops import nn as N


def _eligible(n: Node) -> bool:
    if n.op not in (N.Conv, FC.FusedConv) or len(n.inputs) < 2:
        return False
    x, w = n.inputs[0], n.inputs[1]
    x_shape = getattr(x.type, "shape", None) if x is not None else None
    if w is None or w.const is None or w.const.ndim != 4 or x_shape is None or len(x_shape) != 4:
        return False
    return x.type.dtype is DType.float32 and w.type is not None and w.type.dtype is DType.float32


def _as_fused(n: Node) -> Node:
    """Conv(x, W, b) -> FusedConv(x, W, b) with no epilogue: same node, oneDNN-ready."""
    a = n.attrs
    attrs = FC.FusedConv.make_attrs(auto_pad=a.auto_pad or "NOTSET", dilations=a.dilations,
                                    group=a.group or 1, kernel_shape=a.kernel_shape, pads=a.pads,
                                    strides=a.strides, layout="nhwc")
    return Node(FC.FusedConv, n.name, n.inputs, n.outputs, attrs)


def set_conv_layout(graph: Graph, log) -> int:
    count = 0
    for i, n in enumerate(graph.nodes):
        if not _eligible(n) or (n.op is FC.FusedConv and n.attrs.layout == "nhwc"):
            continue
        if n.op is N.Conv:
            graph.nodes[i] = _as_fused(n)
        else:
            n.attrs = FC.FusedConv.make_attrs(**{**vars(n.attrs), "layout": "nhwc"})
        log(f"layout {n.name}: NHWC, packed weight")
        count += 1
    return count


PASSES = [("set_conv_layout", set_conv_layout)]
