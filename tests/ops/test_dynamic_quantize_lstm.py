"""com.microsoft DynamicQuantizeLSTM against onnxruntime (its own contrib op), and its integer
arithmetic against an exact NumPy evaluation of one step.

On AVX2 without VNNI onnxruntime's uint8 x int8 GEMM saturates each pair of products to int16
(255 * 127 * 2 > 32767); kiln's FBGEMM path saturates the same pairs (as its Int8MatMul does),
tested on full-range weights; the other cases keep signed weights within [-63, 63], where both
are exact. From batch 2 (hidden <= 256) onnxruntime quantizes each thread's rows of h with their
own parameters, an artefact of its threading kiln does not copy, so the batch-2 case uses a
hidden size of 264, where it quantizes the whole batch as kiln does."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.kernels.torch.dynamic_quantize_lstm import dynamic_params
from tests.ops.harness import run_kiln

RNG = np.random.default_rng(0)
NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P", "W_scale",
         "W_zero_point", "R_scale", "R_zero_point"]


def _model(seq=5, batch=1, inp=7, hid=6, direction="bidirectional", per_column=False,
           signed=True, lens=None, states=False, peepholes=False):
    dirs = 2 if direction == "bidirectional" else 1
    qt, lo, hi, zp = (np.int8, -63, 64, 0) if signed else (np.uint8, 0, 256, 128)
    sshape = (dirs, 4 * hid) if per_column else (dirs,)
    vals = {
        "W": RNG.integers(lo, hi, (dirs, inp, 4 * hid)).astype(qt),
        "R": RNG.integers(lo, hi, (dirs, hid, 4 * hid)).astype(qt),
        "B": (RNG.standard_normal((dirs, 8 * hid)) * 0.3).astype(np.float32),
        "W_scale": (RNG.random(sshape) * 0.01 + 0.001).astype(np.float32),
        "W_zero_point": np.full(sshape, zp, qt),
        "R_scale": (RNG.random(sshape) * 0.01 + 0.001).astype(np.float32),
        "R_zero_point": np.full(sshape, zp, qt)}
    feeds = {"X": RNG.standard_normal((seq, batch, inp)).astype(np.float32)}
    if lens is not None:
        feeds["sequence_lens"] = np.array(lens, np.int32)
    if states:
        for k in ("initial_h", "initial_c"):
            feeds[k] = RNG.standard_normal((dirs, batch, hid)).astype(np.float32)
    if peepholes:
        vals["P"] = RNG.standard_normal((dirs, 3 * hid)).astype(np.float32)
    node = helper.make_node("DynamicQuantizeLSTM",
                            [k if k in vals or k in feeds else "" for k in NAMES],
                            ["Y", "Y_h", "Y_c"], domain="com.microsoft", hidden_size=hid,
                            direction=direction)
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in feeds.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output]
    graph = helper.make_graph([node], "g", ins, outs,
                              [numpy_helper.from_array(v, k) for k, v in vals.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model, feeds, vals


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("case", [
    {}, {"per_column": True}, {"signed": False}, {"direction": "forward"},
    {"direction": "reverse", "lens": [3]}, {"states": True, "peepholes": True},
    {"seq": 1, "hid": 16}, {"batch": 2, "hid": 264, "seq": 3, "lens": [3, 2], "states": True},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_dynamic_quantize_lstm_matches_onnxruntime(case):
    model, feeds, _ = _model(**case)
    for name, got, want in zip(("Y", "Y_h", "Y_c"), run_kiln(model, feeds), _ort(model, feeds)):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err <= 1e-5, f"{name}: max rel err {err:.2e}"


@pytest.mark.skipif(not __import__("kiln.kernels.torch.int8", fromlist=["K"])._HAS_FBGEMM,
                    reason="needs PyTorch's FBGEMM")
def test_dynamic_quantize_lstm_saturates_as_onnxruntime():
    """Weights of 127 against codes near 255: pairs of products past int16, which onnxruntime
    saturates on AVX2 (exact integers differ from it by 3e-2 here)."""
    model, feeds, _ = _model(seq=4, inp=64, hid=32, direction="forward")
    w = {i.name: i for i in model.graph.initializer}["W"]
    codes = RNG.integers(-127, 128, (1, 64, 128)).astype(np.int8)
    codes[0, :, ::2] = 127
    w.CopyFrom(numpy_helper.from_array(codes, "W"))
    feeds["X"] = (np.abs(feeds["X"]) + 1).astype(np.float32)
    got, want = run_kiln(model, feeds)[0], _ort(model, feeds)[0]
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-5


def test_dynamic_quantize_lstm_one_step_exact_integers():
    """One forward step from zero state is sigmoid/tanh of x's uint8 quantization times the
    8-bit W in integers, scaled back, plus the biases — evaluated here in NumPy, with weights
    large enough that onnxruntime's AVX2 kernel saturates: its integers (pairs of u8 x s8
    products summed in int16, saturating) where kiln runs FBGEMM on a CPU without VNNI, exact
    ones elsewhere."""
    from kiln.kernels.torch.int8 import _HAS_FBGEMM, u8s8_saturates

    hid, inp = 4, 6
    model, feeds, vals = _model(seq=1, inp=inp, hid=hid, direction="forward")
    vals["W"] = RNG.integers(-128, 128, vals["W"].shape).astype(np.int8)
    for init in model.graph.initializer:
        if init.name == "W":
            init.CopyFrom(numpy_helper.from_array(vals["W"], "W"))
    x = feeds["X"].reshape(1, inp)
    scale, zp = dynamic_params(__import__("torch").from_numpy(x))
    q = np.clip(np.round(x / scale) + zp, 0, 255).astype(np.int64) - zp
    w0 = vals["W"][0].astype(np.int64)
    acc = q @ w0
    # (k, k + 1) pairs of raw codes, saturated; then the zero point's share
    if _HAS_FBGEMM and u8s8_saturates():
        pairs = ((q + zp)[:, :, None] * w0[None]).reshape(1, inp // 2, 2, -1).sum(2)
        acc = np.clip(pairs, -32768, 32767).sum(1) - zp * w0.sum(0)
    gates = acc.astype(np.float32) * np.float32(scale * vals["W_scale"][0])
    gates = gates + vals["B"][0, :4 * hid] + vals["B"][0, 4 * hid:]
    i, o, f, c = np.split(gates.astype(np.float64), 4, axis=-1)

    def sig(v):
        return 1 / (1 + np.exp(-v))

    cell = sig(i) * np.tanh(c)
    h = sig(o) * np.tanh(cell)
    y, y_h, y_c = run_kiln(model, feeds)
    np.testing.assert_allclose(y_h[0], h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_c[0], cell, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[0, 0], h, rtol=1e-5, atol=1e-6)


def test_dynamic_params_follow_dynamic_quantize_linear():
    import torch

    scale, zp = dynamic_params(torch.tensor([-1.0, 3.0]))
    assert scale == np.float32(4.0) / np.float32(255) and zp == 64  # 1 / (4/255) = 63.75
    assert dynamic_params(torch.zeros(3)) == (np.float32(1), 0)
    scale, zp = dynamic_params(torch.tensor([0.5, 2.0]))  # range widened to hold 0
    assert zp == 0 and scale == np.float32(2.0) / np.float32(255)


def test_dynamic_quantize_lstm_without_scales_is_refused():
    model, feeds, _ = _model(direction="forward")
    node = model.graph.node[0]
    node.input[8] = ""  # no W_scale
    with pytest.raises(Exception, match="W_scale"):
        run_kiln(model, feeds)


@pytest.mark.skipif(not __import__("kiln").native.available, reason="needs kiln.native")
@pytest.mark.parametrize("case", [
    {"states": True, "peepholes": True}, {"direction": "reverse", "lens": [3]},
    {"batch": 3, "hid": 13, "seq": 4, "lens": [4, 0, 2], "states": True},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_dynamic_quantize_lstm_native_recurrence_matches_torch_steps(case, monkeypatch):
    """kiln_dq_lstm (rnn.c) against the kernel's PyTorch recurrence: the same codes every
    step (so the same integers), states to the activations' float32 rounding; its odd hidden
    size takes the vector tails, a zero length the empty row."""
    from kiln.kernels.torch import dynamic_quantize_lstm as DL

    model, feeds, _ = _model(**case)
    calls = []
    native, both = DL._run_native, DL._run_native_dirs
    monkeypatch.setattr(DL, "_run_native", lambda *a: calls.append(1) or native(*a))
    monkeypatch.setattr(DL, "_run_native_dirs", lambda *a: calls.append(2) or both(*a))
    got = run_kiln(model, feeds)
    assert calls and set(calls) == {
        2 if case.get("direction", "bidirectional") == "bidirectional" else 1}
    monkeypatch.setattr(DL, "_native_fits", lambda n, rq, x: False)
    want = run_kiln(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not __import__("kiln").native.available or
                    not __import__("kiln").native.qconv_available(), reason="needs AVX512-VNNI")
@pytest.mark.parametrize("case", [
    {"hid": 13, "seq": 4, "states": True}, {"hid": 40, "signed": False, "lens": [3]},
    {"batch": 3, "hid": 13, "seq": 4, "lens": [4, 0, 2], "states": True, "peepholes": True},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_dynamic_quantize_lstm_vnni_step_matches_int16_step(case, monkeypatch):
    """kiln_dq_lstm's VNNI step (R as int8 panels) against its int16 pairs: the same integers,
    so the same outputs to the bit (odd H, a partial 32-column panel, uint8 R shifted by its
    zero point 128, several rows)."""
    from kiln.kernels.torch import dynamic_quantize_lstm as DL

    model, feeds, _ = _model(**case)
    made = []
    real = DL._vnni_r
    monkeypatch.setattr(DL, "_vnni_r", lambda n, w: made.append(r := real(n, w)) or r)
    got = run_kiln(model, feeds)
    assert made and all(r is not None for r in made)
    monkeypatch.setattr(DL, "_vnni_r", lambda n, w: None)
    want = run_kiln(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.skipif(not __import__("kiln").native.available, reason="needs kiln.native")
@pytest.mark.parametrize("isa", ["vnni", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_bidirectional_directions_in_one_call_match_one_by_one(isa, threads, monkeypatch):
    """A bidirectional layer's two recurrences in one C call (a direction per thread of kiln's
    team) give what the two calls one after the other give, to the bit, on the VNNI step and
    on the int16 one (KILN_QGEMM_PATH=avx2 turns VNNI's kernels off); lengths that differ per
    row and states in."""
    import torch

    from kiln import native
    from kiln.kernels.torch import dynamic_quantize_lstm as DL

    if isa not in native.qgemm_paths():
        pytest.skip(f"this CPU has no {isa} path")
    monkeypatch.setenv("KILN_QGEMM_PATH", isa)
    model, feeds, _ = _model(batch=3, hid=40, seq=6, lens=[6, 2, 5], states=True)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = []
        both = DL._run_native_dirs
        monkeypatch.setattr(DL, "_run_native_dirs", lambda *a: calls.append(1) or both(*a))
        got = run_kiln(model, feeds)
        assert calls
        monkeypatch.setattr(DL, "_run_native_dirs", lambda jobs: [DL._run_native(j)
                                                                  for j in jobs])
        want = run_kiln(model, feeds)
    finally:
        torch.set_num_threads(old)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.skipif(not __import__("kiln").native.available, reason="needs kiln.native")
@pytest.mark.parametrize("case", [{}, {"batch": 3, "hid": 13, "seq": 4, "lens": [4, 1, 3]}],
                         ids=["full", "lens"])
def test_both_input_projections_in_one_gemm(case, monkeypatch):
    """A bidirectional layer's two input projections in one qgemm call (the backward rows
    reversed after the product) give what the two FBGEMM products of the forward and the
    reversed input give, to the bit. Must not fire: uint8 weights with a zero point, and a CPU
    whose u8 x s8 GEMMs saturate (onnxruntime's integers there are not qgemm's)."""
    from kiln.kernels.torch import dynamic_quantize_lstm as DL
    from kiln.kernels.torch import int8 as K

    if K.u8s8_saturates():
        pytest.skip("this CPU's u8 x s8 GEMMs saturate: the merged product does not run")
    model, feeds, _ = _model(**case)
    made = []
    real = DL._both_projections
    monkeypatch.setattr(DL, "_both_projections",
                        lambda *a: made.append(r := real(*a)) or r)
    got = run_kiln(model, feeds)
    assert any(r is not None for r in made)  # (the build's run on zero lengths has no steps)
    monkeypatch.setattr(DL, "_both_projections", lambda *a: None)
    want = run_kiln(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    monkeypatch.setattr(DL, "_both_projections", real)
    unsigned, feeds_u, _ = _model(signed=False, **case)
    made.clear()
    monkeypatch.setattr(DL, "_both_projections", lambda *a: made.append(r := real(*a)) or r)
    run_kiln(unsigned, feeds_u)
    assert made and all(r is None for r in made)
    monkeypatch.setattr(K, "u8s8_saturates", lambda: True)
    made.clear()
    run_kiln(model, feeds)
    assert made and all(r is None for r in made)


def test_no_vnni_step_for_weights_beyond_int8():
    """Must not fire: integer weights beyond int8 (uint8 codes, zero point 0) keep the int16
    pairs."""
    from types import SimpleNamespace

    import torch

    from kiln.kernels.torch import dynamic_quantize_lstm as DL

    w = torch.tensor([[0.0, 255.0], [3.0, -4.0]])
    assert DL._vnni_r(SimpleNamespace(cache={}), w) is None
    assert DL._vnni_r(SimpleNamespace(cache={}), w.clamp(max=127)) is not None or \
        not __import__("kiln").native.qconv_available()


def test_reverse_within_full_lengths_is_a_flip():
    """Every row at full length: the time axis flipped, as the gather over lengths gives."""
    import torch

    from kiln.kernels.torch import dynamic_quantize_lstm as DL

    x = torch.arange(5 * 3 * 2, dtype=torch.float32).reshape(5, 3, 2)
    full = torch.full((3,), 5, dtype=torch.int64)
    t = torch.arange(5)[:, None]
    idx = torch.where(t < full[None, :], full[None, :] - 1 - t, t)[..., None].expand_as(x)
    assert torch.equal(DL._reverse_within(x, full), x.gather(0, idx))
    part = torch.tensor([5, 2, 0])
    got = DL._reverse_within(x, part)
    assert torch.equal(got[:, 0], x.flip(0)[:, 0]) and torch.equal(got[:2, 1], x[:2, 1].flip(0))
    assert torch.equal(got[2:, 1], x[2:, 1]) and torch.equal(got[:, 2], x[:, 2])
