"""RNN, GRU and LSTM nodes, and a lone Gemm/MatMul head, as native program records
(kiln.engine.program_rnn, kiln.engine.program_linear): every direction, both layouts, short
sequences (the input projection inside the recurrence) and long ones (a GEMM record first),
initial states (one given as a strided view), constant sequence_lens; checked against
onnxruntime (layout 0: onnxruntime does not run layout 1) and against the same engine on the
Python loop (the PyTorch kernels), with no torch record left in the plan."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _rnn_model(kind, direction, layout, seq, batch, hid=5, inp=7, init=False, lens=False,
               transposed_h0=False):
    rng = np.random.default_rng(seq * 10 + batch)
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[kind]
    st = [batch, dirs, hid] if layout else [dirs, batch, hid]
    x_shape = [batch, seq, inp] if layout else [seq, batch, inp]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in (("W", (dirs, g * hid, inp)), ("R", (dirs, g * hid, hid)),
                          ("B", (dirs, 2 * g * hid)))]
    ins = ["x", "W", "R", "B", "", ""]
    inputs = {"x": x_shape}
    nodes = []
    if lens:
        sl = rng.integers(1, seq + 1, batch).astype(np.int32)
        inits.append(numpy_helper.from_array(sl, "lens"))
        ins[4] = "lens"
    if init:
        if transposed_h0:  # h0 given as [hid, batch, dirs]-shaped input, transposed in
            inputs["h0t"] = list(reversed(st))
            nodes.append(helper.make_node("Transpose", ["h0t"], ["h0"], perm=[2, 1, 0]))
        else:
            inputs["h0"] = st
        ins[5] = "h0"
        if kind == "LSTM":
            inputs["c0"] = st
            ins.append("c0")
    outs = ["y", "yh"] + (["yc"] if kind == "LSTM" else [])
    nodes.append(helper.make_node(kind, ins, ["ry", "ryh"] + (["ryc"] if kind == "LSTM"
                                                              else []),
                                  hidden_size=hid, direction=direction, layout=layout))
    nodes += [helper.make_node("Neg", ["r" + o], [o]) for o in outs]
    g = helper.make_graph(nodes, "rnn", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s)
                                         for k, s in inputs.items()],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                           for o in outs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), inputs


def _feeds(inputs: dict, seed=1) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in inputs.items()}


def _run(model, feeds, tmp_path, with_ort: bool):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu", tf32=False)).build(str(path))
    ctx = engine.create_context()
    names = [o.name for o in engine.outputs]
    ctx.run(feeds)  # traced
    got = ctx.run(feeds)
    plans = [p for p in engine._executor.program.plans.values() if p]
    assert len(plans) == 1
    torch_ops = Counter(fb.step.node.op.name for fb in plans[0].fallbacks)
    program = engine._executor.program
    engine._executor.program = None  # the Python loop: the PyTorch kernels
    loop = ctx.run(feeds)
    engine._executor.program = program
    for k in names:
        scale = max(1.0, float(np.abs(loop[k]).max()))
        assert float(np.abs(got[k] - loop[k]).max()) <= 1e-5 * scale, k
    if with_ort:
        want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            names, feeds)
        for k, w in zip(names, want):
            assert got[k].shape == w.shape
            assert float(np.abs(got[k] - w).max()) <= 1e-4 * max(1.0, float(np.abs(w).max()))
    return torch_ops


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("seq,batch", [(1, 1), (3, 2), (17, 3)])
@pytest.mark.parametrize("direct_rows", [0, 8])  # a GEMM record first (the default); rows
def test_recurrent_record_matches(kind, direction, layout, seq, batch, direct_rows, tmp_path,
                                  monkeypatch):  # of up to 8 made inside the recurrence
    from kiln.engine import program_rnn

    monkeypatch.setattr(program_rnn, "DIRECT_ROWS", direct_rows)
    init = seq > 1
    model, inputs = _rnn_model(kind, direction, layout, seq, batch, init=init,
                               lens=batch > 1 and layout == 0)
    torch_ops = _run(model, _feeds(inputs), tmp_path, with_ort=layout == 0)
    assert not torch_ops


def test_recurrent_record_strided_initial_state(tmp_path):
    model, inputs = _rnn_model("GRU", "bidirectional", 0, 4, 3, init=True, transposed_h0=True)
    assert not _run(model, _feeds(inputs), tmp_path, with_ort=True)


def test_no_recurrent_record_for_an_activation_rnn_c_lacks(tmp_path):
    """Softsign: the traced run took the PyTorch step loop, so the step stays a torch record."""
    model, inputs = _rnn_model("RNN", "forward", 0, 3, 1)
    model.graph.node[0].attribute.append(helper.make_attribute("activations", ["Softsign"]))
    assert _run(model, _feeds(inputs), tmp_path, with_ort=True) == Counter({"RNN": 1})


# ---- lone GEMM heads --------------------------------------------------------------------------

def _head_model(op: str):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((12, 16) if op == "Gemm" else (16, 12)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(12) * 0.3).astype(np.float32)
    mk = helper.make_node
    if op == "Gemm":  # [2, 4, 4] -> Flatten -> Gemm(transB) -> Sigmoid
        shape = [2, 4, 4]
        nodes = [mk("Flatten", ["x"], ["f"]), mk("Gemm", ["f", "w", "b"], ["g"], transB=1),
                 mk("Sigmoid", ["g"], ["y"])]
    else:  # [2, 3, 16] transposed from [2, 16, 3] -> MatMul -> Add bias -> Add residual
        shape = [2, 16, 3]
        # (the Neg between the Slice and the MatMul: two in a row would be a native chain)
        nodes = [mk("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
                 mk("Slice", ["t", "s0", "s1", "s2"], ["r0"]), mk("Neg", ["r0"], ["r"]),
                 mk("MatMul", ["t", "w"], ["m"]), mk("Add", ["m", "b"], ["a"]),
                 mk("Add", ["a", "r"], ["y"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")] + [
        numpy_helper.from_array(np.array([v], np.int64), n)
        for n, v in (("s0", 0), ("s1", 12), ("s2", 2))]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, shape)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), {"x": shape}


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
@pytest.mark.parametrize("tactic", ["kiln", "linear"])
def test_gemm_head_record_matches(op, tactic, tmp_path, monkeypatch):
    """A record where kiln's GEMM is the node's tactic; F.linear's stays a torch record."""
    from kiln.kernels.torch import fused_conv

    monkeypatch.setattr(fused_conv, "_FORCED", tactic)
    model, inputs = _head_model(op)
    torch_ops = _run(model, _feeds(inputs), tmp_path, with_ort=True)
    fused = "FusedGemm" if op == "Gemm" else "FusedMatMul"
    assert torch_ops == (Counter() if tactic == "kiln" else Counter({fused: 1}))
