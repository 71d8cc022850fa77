import numpy as np
import pytest

from kiln.ops import fused_transformer as FT
from kiln.passes.fusion.attention import fuse_attention
from tests.passes.transformer_util import apply, c, feeds, model, node

B, S, H, D = 2, 6, 2, 4
E = H * D
INITS = {"split": np.array([0, 0, H, D]), "merge": np.array([0, 0, E]), "scale": c(np.sqrt(D)),
         "big": c(-10000.0), "tril": np.tril(np.ones((1, 1, 16, 16), bool)),
         "zero2": np.array([0, 0]), "ends": np.array([S, S]), "axes": np.array([2, 3]),
         "one": c(1.0)}


def attention_nodes(mask="add", scale="Div"):
    ns = [node("Reshape", ["q3", "split"], "q4"),
          node("Transpose", ["q4"], "q", perm=[0, 2, 1, 3]),
          node("Reshape", ["k3", "split"], "k4"),
          node("Transpose", ["k4"], "kt", perm=[0, 2, 3, 1]),
          node("Reshape", ["v3", "split"], "v4"),
          node("Transpose", ["v4"], "v", perm=[0, 2, 1, 3]),
          node("MatMul", ["q", "kt"], "s0"), node(scale, ["s0", "scale"], "s1")]
    last = "s1"
    if mask == "add":
        ns.append(node("Add", ["s1", "mask"], "s2"))
        last = "s2"
    elif mask == "causal":
        ns += [node("Slice", ["tril", "zero2", "ends", "axes"], "keep"),
               node("Where", ["keep", "s1", "big"], "s2")]
        last = "s2"
    return ns + [node("Softmax", [last], "p", axis=-1), node("MatMul", ["p", "v"], "o4"),
                 node("Transpose", ["o4"], "o", perm=[0, 2, 1, 3]),
                 node("Reshape", ["o", "merge"], "y")]


QKV = {"q3": ["b", S, E], "k3": ["b", S, E], "v3": ["b", S, E]}


def qkv_feeds(**extra):
    return feeds(q3=(B, S, E), k3=(B, S, E), v3=(B, S, E), **extra)


def test_attention_masked_structure_counts_numerics():
    m = model(attention_nodes(), dict(QKV, mask=["b", 1, 1, S]), ["y"], INITS)
    f = qkv_feeds(mask=(B, 1, 1, S))
    f["mask"] = np.where(f["mask"] > 0, 0, -10000).astype(np.float32)
    g, before, after, n, logs = apply(m, fuse_attention, f)
    assert n == 1 and after == {"Attention": 1}
    assert before == {"Add": 1, "Div": 1, "MatMul": 2, "Reshape": 4, "Softmax": 1,
                      "Transpose": 4}
    (at,) = g.nodes
    assert at.op is FT.Attention and at.inputs == g.inputs  # q3, k3, v3, mask in order
    assert at.attrs.num_heads == H and at.attrs.causal == 0
    assert abs(at.attrs.scale - 1 / np.sqrt(D)) < 1e-7
    assert at.outputs[0] is g.outputs[0] and logs[0].startswith("fused q4 + q + k4")


def test_attention_causal_where_mul_scale():
    inits = dict(INITS, scale=c(1 / np.sqrt(D)))
    m = model(attention_nodes("causal", "Mul"), QKV, ["y"], inits)
    g, _, after, n, _ = apply(m, fuse_attention, qkv_feeds())
    assert n == 1 and after == {"Attention": 1, "Slice": 1}  # the mask Slice is left for DCE
    at = next(x for x in g.nodes if x.op is FT.Attention)
    assert at.attrs.causal == 1 and len(at.inputs) == 3


def test_attention_core_only_when_heads_are_read_elsewhere():
    m = model(attention_nodes(None), QKV, ["y", "kt"], INITS)  # K^T is also an output
    g, _, after, n, _ = apply(m, fuse_attention, qkv_feeds())
    assert n == 1 and after["Attention"] == 1 and after["Transpose"] == 4
    at = next(x for x in g.nodes if x.op is FT.Attention)
    assert at.attrs.num_heads == 0


def test_no_fuse_attention_mask_before_scale():
    ns = attention_nodes(None)
    ns[7] = node("Add", ["s0", "mask"], "sm")
    ns.insert(8, node("Div", ["sm", "scale"], "s1"))  # (s + mask) / c: the mask is scaled
    m = model(ns, dict(QKV, mask=["b", 1, 1, S]), ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_attention, qkv_feeds(mask=(B, 1, 1, S)))
    assert n == 0 and before == after


def test_no_fuse_attention_not_causal_where():
    inits = dict(INITS, tril=np.triu(np.ones((1, 1, 16, 16), bool)))  # keeps the future
    m = model(attention_nodes("causal"), QKV, ["y"], inits)
    _, before, after, n, _ = apply(m, fuse_attention, qkv_feeds())
    assert n == 0 and before == after


def test_no_fuse_attention_softmax_other_axis():
    ns = attention_nodes()
    ns[9] = node("Softmax", ["s2"], "p", axis=2)
    m = model(ns, dict(QKV, mask=["b", 1, 1, S]), ["y"], INITS)
    _, before, after, n, _ = apply(m, fuse_attention, qkv_feeds(mask=(B, 1, 1, S)))
    assert n == 0 and before == after


def _decode_step(mask_shape):
    """One query against S keys, the mask Expanded to a shape computed from an input, so that
    inference does not know its dims (as transformers' decode steps export it)."""
    shapes = {"q3": [1, 1, E], "k3": [1, S, E], "v3": [1, S, E], "m0": mask_shape, "shp": [4]}
    ns = [node("Cast", ["shp"], "shpi", to=7), node("Expand", ["m0", "shpi"], "mask")]
    return model(ns + attention_nodes(), shapes, ["y"], INITS)


def _decode_feeds(mask_shape):
    f = feeds(q3=(1, 1, E), k3=(1, S, E), v3=(1, S, E), m0=mask_shape)
    f["m0"] = np.where(f["m0"] > 0, 0, -10000).astype(np.float32)
    f["shp"] = np.array(mask_shape, np.float32)
    return f


@pytest.mark.parametrize("rows", [1, 4])
def test_attention_mask_of_unknown_dims_decode_step(rows):
    """Fused although inference does not know the mask's dims; a mask that turns out to widen
    the scores at run time (``rows`` 4 against one query) still gives ONNX's result."""
    mask = (1, 1, rows, S)
    g, before, after, n, _ = apply(_decode_step(list(mask)), fuse_attention, _decode_feeds(mask))
    assert n == 1 and after["Attention"] == 1
    assert before["Softmax"] == 1 and "Softmax" not in after and "MatMul" not in after
    (at,) = [x for x in g.nodes if x.op is FT.Attention]
    assert at.inputs[3].producer.op.name == "Expand"
    assert at.inputs[3].type.shape[2] is None  # what the rule is about


def test_no_fuse_attention_mask_wider_than_the_scores():
    # the mask's known query dim (4) widens the scores' (1): the Add is not a masked score
    m = model(attention_nodes(), {"q3": [1, 1, E], "k3": [1, S, E], "v3": [1, S, E],
                                  "mask": [1, 1, 4, S]}, ["y"], INITS)
    f = feeds(q3=(1, 1, E), k3=(1, S, E), v3=(1, S, E), mask=(1, 1, 4, S))
    _, before, after, n, logs = apply(m, fuse_attention, f)
    assert n == 0 and before == after
