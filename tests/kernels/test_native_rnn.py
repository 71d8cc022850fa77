"""kiln.native's RNN/GRU/LSTM recurrence (``kiln_rnn`` in kiln/native/rnn.c) against the
step-by-step PyTorch kernels run in float64 — every direction, both layouts, GRU with and without
linear_before_reset, sequence_lens, initial states, peepholes, clip, input_forget, activations
with alpha/beta, hidden sizes that are not multiples of 8, short sequences (input projection
inside the recurrence) and long ones (one GEMM first) — and against onnxruntime on whole nodes.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kiln import native
from kiln.kernels.registry import Call
from kiln.kernels.torch import rnn as K

needs_native = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
KERNEL = {"RNN": K.rnn, "GRU": K.gru, "LSTM": K.lstm}
STEPS = {"RNN": K.rnn_steps, "GRU": K.gru_steps, "LSTM": K.lstm_steps}
RTOL = 1e-4  # of max |reference|: a tanh RNN over 17 steps amplifies float32 rounding (PyTorch
# float32 steps are 2.3e-5 off float64 there); a wrong gate or step is off by O(1)


def _attrs(**kw):
    a = dict(activations=None, activation_alpha=None, activation_beta=None, clip=None,
             direction="forward", hidden_size=None, layout=0, linear_before_reset=0,
             input_forget=0)
    a.update(kw)
    return SimpleNamespace(**a)


def _case(kind, *, direction="forward", layout=0, hid=6, batch=2, seq=5, inp=7, lens=False,
          init=False, peep=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    dirs = 2 if direction == "bidirectional" else 1
    x = torch.randn((batch, seq, inp) if layout else (seq, batch, inp), generator=g)
    w = torch.randn(dirs, GATES[kind] * hid, inp, generator=g) * 0.5
    r = torch.randn(dirs, GATES[kind] * hid, hid, generator=g) * 0.5
    b = torch.randn(dirs, 2 * GATES[kind] * hid, generator=g) * 0.3
    sl = torch.randint(1, seq + 1, (batch,), generator=g, dtype=torch.int32) if lens else None
    st = (batch, dirs, hid) if layout else (dirs, batch, hid)
    h0 = torch.randn(st, generator=g) if init else None
    c0 = torch.randn(st, generator=g) if init and kind == "LSTM" else None
    p = torch.randn(dirs, 3 * hid, generator=g) if peep else None
    args = [x, w, r, b, sl, h0] + ([c0, p] if kind == "LSTM" else [])
    return args


def _run_native(kind, a, args):
    n_out = 3 if kind == "LSTM" else 2
    call = Call(a, n_out, len(args))
    got = KERNEL[kind](call, *args)
    assert call.cache.get("rnn_run") is not None, "the C recurrence did not take the node"
    return got


def _check(kind, a, args):
    n_out = 3 if kind == "LSTM" else 2
    call = Call(a, n_out, len(args))
    got = KERNEL[kind](call, *args)
    assert call.cache.get("rnn_run") is not None, "the C recurrence did not take the node"
    ref = STEPS[kind](Call(a, n_out, len(args)),
                      *[t.double() if t is not None and t.is_floating_point() else t
                        for t in args])
    for g, w in zip(got, ref):
        assert g.shape == w.shape and g.dtype == torch.float32, (g.shape, w.shape, g.dtype)
        err, scale = float((g.double() - w).abs().max()), float(w.abs().max())
        assert err <= RTOL * max(scale, 1.0), f"max error {err:.3g} (scale {scale:.3g})"


@needs_native
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("seq,batch", [(1, 1), (3, 2), (17, 3)])  # direct rows, then a GEMM
def test_native_rnn_matches_steps(kind, direction, layout, seq, batch):
    for hid, lens, init in itertools.product([5, 16], [False, True], [False, True]):
        args = _case(kind, direction=direction, layout=layout, hid=hid, batch=batch, seq=seq,
                     lens=lens, init=init, peep=kind == "LSTM" and init)
        _check(kind, _attrs(direction=direction, layout=layout), args)


@needs_native
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("seq", [2, 12])
def test_native_gru_linear_before_reset(direction, seq):
    for lbr, hid in itertools.product([0, 1], [3, 24]):
        args = _case("GRU", direction=direction, hid=hid, seq=seq, lens=True, init=True)
        _check("GRU", _attrs(direction=direction, linear_before_reset=lbr), args)


@needs_native
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_native_rnn_clip_and_activations(kind):
    acts = {"RNN": ["Relu", "LeakyRelu"], "GRU": ["HardSigmoid", "ScaledTanh"],
            "LSTM": ["HardSigmoid", "Affine", "Tanh"]}[kind]
    args = _case(kind, direction="bidirectional", seq=6, lens=True, init=True)
    _check(kind, _attrs(direction="bidirectional", clip=0.8, activations=acts,
                        activation_alpha=[0.3, 0.7], activation_beta=[0.4]), args)


@needs_native
def test_native_lstm_input_forget_and_peepholes():
    for seq in (2, 11):
        args = _case("LSTM", direction="bidirectional", seq=seq, lens=True, init=True,
                     peep=True, hid=9)
        _check("LSTM", _attrs(direction="bidirectional", input_forget=1), args)


@needs_native
def test_native_rnn_parallel_directions_large():
    """Enough work for the two directions to run side by side on two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = _case("LSTM", direction="bidirectional", hid=64, seq=40, batch=2, inp=32,
                     init=True)
        _check("LSTM", _attrs(direction="bidirectional"), args)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_native_rnn_parallel_columns_large(kind):
    """One direction wide enough (batch x hidden x gate columns >= 2^17) for each step's GEMV to
    be split by column blocks over kiln's team; some batch rows end early (lens)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = _case(kind, direction="forward", hid=136, seq=6, batch=3, inp=16, init=True,
                     lens=True)
        _check(kind, _attrs(direction="forward"), args)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("kind, hid", [("GRU", 48), ("LSTM", 40), ("GRU", 96), ("RNN", 136)])
def test_native_rnn_isas_agree_to_the_bit(kind, hid, conv_isa):
    """The recurrent GEMV's AVX-512 blocks (128 columns) sum each column as the AVX2 blocks do,
    and the columns past them take the AVX2 path: both ISAs give the same bits, and match the
    reference (run under each ISA by the conv_isa fixture, against the AVX2 result). Eight
    rows: the input projection is the same GEMV, inside the recurrence (a GEMM's ISAs may
    differ in the last bit)."""
    args = _case(kind, direction="bidirectional", hid=hid, seq=4, batch=2, inp=24, init=True)
    a = _attrs(direction="bidirectional")
    _check(kind, a, args)
    got = _run_native(kind, a, args)
    native.set_conv_isa("avx2")
    try:
        want = _run_native(kind, a, args)
    finally:
        native.set_conv_isa(conv_isa)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_native_rnn_declines_what_it_lacks():
    """An activation the C kernel has no code for, or float64 input: the step-by-step path
    runs the node (and gives the same as the reference)."""
    args = _case("GRU")
    a = _attrs(activations=["Softsign", "Tanh"])
    call = Call(a, 2, len(args))
    got = K.gru(call, *args)
    assert call.cache.get("rnn_run", "unset") is None or not native.available
    want = K.gru_steps(Call(a, 2, len(args)), *args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    d64 = [t.double() if t is not None and t.is_floating_point() else t for t in args]
    call = Call(_attrs(), 2, len(args))
    assert K.gru(call, *d64)[0].dtype == torch.float64
    assert "rnn_run" not in call.cache


@needs_native
def test_native_rnn_repacks_new_weights():
    """The packed weights follow the weight tensors a node is called with."""
    a = _attrs()
    call = Call(a, 2, 6)
    first = _case("GRU", seed=1)
    second = _case("GRU", seed=2)
    K.gru(call, *first)
    got = K.gru(call, *second)
    want = K.gru_steps(Call(a, 2, 6), *second)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@needs_native
def test_native_rnn_bad_input_names_the_problem():
    args = _case("LSTM", init=True)
    args[5] = torch.zeros(1, 2, 3)  # initial_h of the wrong hidden size
    with pytest.raises(ValueError, match="initial state h0"):
        K.lstm(Call(_attrs(), 3, len(args)), *args)


def _ort_node(kind, inputs: dict, n_out: int, **attrs):
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][:len(inputs)]
    feeds = {k: v for k, v in zip(names, inputs.values()) if v is not None}
    node = helper.make_node(kind, [k if k in feeds else "" for k in names],
                            ["Y", "Y_h", "Y_c"][:n_out], **attrs)
    ins = [helper.make_tensor_value_info(k, TensorProto.INT32 if k == "sequence_lens"
                                         else TensorProto.FLOAT, v.shape)
           for k, v in feeds.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output]
    m = helper.make_model(helper.make_graph([node], "g", ins, outs),
                          opset_imports=[helper.make_opsetid("", 14)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@needs_native
@pytest.mark.parametrize("kind,lbr", [("GRU", 0), ("GRU", 1), ("LSTM", 0), ("RNN", 0)])
def test_native_rnn_matches_onnxruntime(kind, lbr):
    """(onnxruntime's CPU kernels refuse layout 1: that one is checked against the steps.)"""
    hid, layout = 12, 0
    args = _case(kind, direction="bidirectional", layout=layout, hid=hid, seq=9, batch=3,
                 lens=True, init=True, peep=kind == "LSTM")
    extra = {"linear_before_reset": lbr} if kind == "GRU" else {}
    a = _attrs(direction="bidirectional", layout=layout, **extra)
    n_out = 3 if kind == "LSTM" else 2
    got = KERNEL[kind](Call(a, n_out, len(args)), *args)
    names = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
    inputs = {k: (None if t is None else t.numpy()) for k, t in zip(names, args)}
    want = _ort_node(kind, inputs, n_out, hidden_size=hid, direction="bidirectional",
                     layout=layout, **extra)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-5)
