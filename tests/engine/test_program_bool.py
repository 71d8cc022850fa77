"""Bool values and integer-input Casts in native programs (kiln.engine.program_bool): the
attention-mask chains Hugging Face exports write (int64 mask -> Cast -> Flatten -> Gather ->
Reshape -> And -> Where), checked against onnxruntime (to the bit: they only move and select
values), with the plan holding no torch record for them; the new elementwise codes against
numpy; and the cases that must stay torch records."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no native")

mk = helper.make_node
MIN = float(np.finfo(np.float32).min)


def _model(nodes, inputs: dict, inits: list, outputs=None, opset: int = 17):
    outputs = outputs or {"y": TensorProto.FLOAT}
    g = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info(k, dt, s) for k, (dt, s) in inputs.items()],
        [helper.make_tensor_value_info(o, dt, None) for o, dt in outputs.items()], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(model, feeds: dict, tmp_path):
    """(kiln's outputs of planned runs, onnxruntime's, the plan's torch-record op counts,
    the plan)."""
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    engine = kiln.Builder(kiln.BuilderConfig(device="cpu", tf32=False)).build(str(path))
    ctx = engine.create_context()
    names = [o.name for o in model.graph.output]
    ctx.run(feeds)  # the traced run
    got = [ctx.run(feeds) for _ in range(2)]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    plans = [p for p in engine._executor.program.plans.values() if p]
    assert len(plans) == 1
    for n, w in zip(names, want):
        assert got[0][n].dtype == w.dtype and got[0][n].shape == w.shape, n
        np.testing.assert_array_equal(got[0][n], got[1][n])  # the arena reused
    return ([got[0][n] for n in names], want,
            Counter(fb.step.node.op.name for fb in plans[0].fallbacks), plans[0])


def _mask(rng, s):
    m = rng.integers(0, 2, (1, s)).astype(np.int64)
    m[0, 0] = 1
    m[0, -1] = 3  # nonzero is true, not only 1
    return m


def _hf_mask_nodes(s: int, causal_dtype=TensorProto.BOOL):
    """The decode step's mask as transformers 5 exports it (sdpa, torchscript)."""
    rng = np.random.default_rng(3)
    causal = rng.integers(0, 2, (1, 1, 1, s)).astype(bool)
    inits = [numpy_helper.from_array(np.arange(s, dtype=np.int64).reshape(1, 1, 1, s), "idx"),
             numpy_helper.from_array(np.array([1, 1, 1, s], np.int64), "shape"),
             numpy_helper.from_array(causal, "causal"),
             numpy_helper.from_array(np.array([0.0], np.float32), "zero"),
             numpy_helper.from_array(np.array([MIN], np.float32), "min")]
    nodes = [mk("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
             mk("Flatten", ["mb"], ["mf"], axis=2),
             mk("Gather", ["mf", "idx"], ["mg"], axis=0),
             mk("Reshape", ["mg", "shape"], ["mr"]),
             mk("And", ["causal", "mr"], ["ma"]),
             mk("Where", ["ma", "zero", "min"], ["bias"]),
             mk("Add", ["scores", "bias"], ["y"])]
    return nodes, inits


@pytest.mark.parametrize("s", [33, 8])
def test_hf_decode_mask_chain_runs_as_records(s, tmp_path):
    nodes, inits = _hf_mask_nodes(s)
    model = _model(nodes, {"mask": (TensorProto.INT64, [1, s]),
                           "scores": (TensorProto.FLOAT, [1, 4, 1, s])}, inits)
    rng = np.random.default_rng(0)
    feeds = {"mask": _mask(rng, s),
             "scores": rng.standard_normal((1, 4, 1, s)).astype(np.float32)}
    (got,), (want,), torch_ops, plan = _run(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert not torch_ops
    assert 14 in plan.kinds  # the Cast read the int64 input itself (OP_ICAST)


def test_mask_values_change_between_runs(tmp_path):
    """The plan is per shape: a new mask's values go through the same records."""
    s = 12
    nodes, inits = _hf_mask_nodes(s)
    model = _model(nodes, {"mask": (TensorProto.INT64, [1, s]),
                           "scores": (TensorProto.FLOAT, [1, 2, 1, s])}, inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    ctx = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path)).create_context()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for _ in range(4):
        feeds = {"mask": _mask(rng, s),
                 "scores": rng.standard_normal((1, 2, 1, s)).astype(np.float32)}
        np.testing.assert_array_equal(ctx.run(feeds)["y"], sess.run(None, feeds)[0])


@pytest.mark.parametrize("dtype", [TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL])
def test_cast_of_integer_input_to_float(dtype, tmp_path):
    """BERT eager's form: Cast(mask, float) -> (1 - m) * min; values past 2^24 round as
    onnxruntime rounds them."""
    np_dt = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32,
             TensorProto.BOOL: bool}[dtype]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-10000.0, np.float32), "big")]
    nodes = [mk("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
             mk("Sub", ["one", "mf"], ["inv"]), mk("Mul", ["inv", "big"], ["b"]),
             mk("Add", ["scores", "b"], ["y"])]
    model = _model(nodes, {"mask": (dtype, [2, 7]), "scores": (TensorProto.FLOAT, [2, 7])},
                   inits)
    rng = np.random.default_rng(2)
    m = rng.integers(0, 2, (2, 7))
    if dtype != TensorProto.BOOL:
        m[1, 3] = -5
        m[1, 4] = (1 << 24) + 1 if dtype == TensorProto.INT64 else (1 << 30) + 7
    feeds = {"mask": m.astype(np_dt), "scores": rng.standard_normal((2, 7)).astype(np.float32)}
    (got,), (want,), torch_ops, _ = _run(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert not torch_ops


def test_bool_ops_and_bool_outputs(tmp_path):
    """Or, Xor, Not and a float Cast to bool as records; a bool graph output and a bool value
    a torch record reads (Cast to int64) come back as bool tensors."""
    s = 10
    inits = [numpy_helper.from_array(np.random.default_rng(4).integers(0, 2, (1, s)).astype(bool),
                                     "c")]
    nodes = [mk("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
             mk("Cast", ["x"], ["xb"], to=TensorProto.BOOL),
             mk("Or", ["mb", "c"], ["o"]), mk("Xor", ["o", "xb"], ["xo"]),
             mk("Not", ["xo"], ["nb"]),
             mk("Cast", ["nb"], ["ni"], to=TensorProto.INT64),  # a torch record reads bool
             mk("Cast", ["nb"], ["nf"], to=TensorProto.FLOAT),
             mk("Where", ["nb", "x", "m1"], ["w"]),
             mk("Add", ["w", "nf"], ["y"])]
    inits.append(numpy_helper.from_array(np.array(-1.5, np.float32), "m1"))
    model = _model(nodes, {"mask": (TensorProto.INT64, [1, s]), "x": (TensorProto.FLOAT, [1, s])},
                   inits, outputs={"y": TensorProto.FLOAT, "nb": TensorProto.BOOL,
                                     "ni": TensorProto.INT64})
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, s)).astype(np.float32)
    x[0, :3] = [0.0, -0.0, np.nan]
    feeds = {"mask": _mask(rng, s), "x": x}
    got, want, torch_ops, _ = _run(model, feeds, tmp_path)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert got[1].dtype == bool and got[2].dtype == np.int64
    assert torch_ops == Counter({"Cast": 1})  # only the Cast to int64


def test_where_of_two_tensors_stays_torch(tmp_path):
    """Must not fire: Where(mask, a, b) of two tensors has no Select record."""
    nodes = [mk("Cast", ["mask"], ["mb"], to=TensorProto.BOOL),
             mk("Where", ["mb", "a", "b"], ["y"])]
    model = _model(nodes, {"mask": (TensorProto.INT64, [2, 5]), "a": (TensorProto.FLOAT, [2, 5]),
                           "b": (TensorProto.FLOAT, [2, 5])}, [])
    rng = np.random.default_rng(6)
    feeds = {"mask": rng.integers(0, 2, (2, 5)).astype(np.int64),
             "a": rng.standard_normal((2, 5)).astype(np.float32),
             "b": rng.standard_normal((2, 5)).astype(np.float32)}
    (got,), (want,), torch_ops, _ = _run(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert torch_ops == Counter({"Where": 1})


def test_integer_arithmetic_stays_torch(tmp_path):
    """Must not fire: integer math on the input (a CumSum of positions, an Add) is no Cast of
    an input, and its float Cast reads a torch result: torch records, the right values."""
    inits = [numpy_helper.from_array(np.array(1, np.int64), "ax"),
             numpy_helper.from_array(np.array(2, np.int64), "two")]
    nodes = [mk("CumSum", ["mask", "ax"], ["cs"]), mk("Add", ["cs", "two"], ["p"]),
             mk("Cast", ["p"], ["pf"], to=TensorProto.FLOAT), mk("Neg", ["pf"], ["y"])]
    model = _model(nodes, {"mask": (TensorProto.INT64, [1, 6])}, inits)
    feeds = {"mask": np.array([[1, 1, 0, 1, (1 << 40) + 3, 1]], np.int64)}
    (got,), (want,), torch_ops, _ = _run(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert torch_ops["Cast"] == 1


def test_gather_by_multidim_arange_is_a_view(tmp_path):
    """Gather by constant indices of any rank that step evenly: a view (no record); uneven
    2-D indices stay a torch record."""
    for idx, records in ((np.arange(6).reshape(1, 2, 3), 0),
                         (np.arange(0, 6, 2).reshape(3, 1), 0),
                         (np.array([[0, 2], [1, 5]]), 1)):
        inits = [numpy_helper.from_array(idx.astype(np.int64), "i")]
        nodes = [mk("Gather", ["x", "i"], ["g"], axis=1), mk("Neg", ["g"], ["y"])]
        model = _model(nodes, {"x": (TensorProto.FLOAT, [2, 6, 3])}, inits)
        x = np.random.default_rng(7).standard_normal((2, 6, 3)).astype(np.float32)
        (got,), (want,), torch_ops, _ = _run(model, {"x": x}, tmp_path)
        np.testing.assert_array_equal(got, want)
        assert sum(torch_ops.values()) == records


@pytest.mark.parametrize("n", [1, 7, 8, 19])
def test_select_and_nonzero_codes(n):
    """The elementwise codes bool values use, against numpy, with broadcasting."""
    rng = np.random.default_rng(n)
    a = torch.from_numpy(rng.integers(0, 2, (3, n)).astype(np.float32))
    a[0, 0] = float("nan")
    a[1, 0] = -0.0
    b = torch.from_numpy(rng.standard_normal((1, n)).astype(np.float32))
    an, bn = a.numpy(), b.numpy()
    np.testing.assert_array_equal(native.pointwise("NonZero", a).numpy(),
                                  (an != 0).astype(np.float32))
    np.testing.assert_array_equal(native.pointwise("Select", a, p0=2.5, p1=MIN).numpy(),
                                  np.where(an != 0, 2.5, MIN).astype(np.float32))
    np.testing.assert_array_equal(native.pointwise("SelectB", a, b, p0=-7.0).numpy(),
                                  np.where(an != 0, bn, -7.0).astype(np.float32))
    np.testing.assert_array_equal(native.pointwise("SelectA", a, b, p0=float("-inf")).numpy(),
                                  np.where(an != 0, -np.inf, bn).astype(np.float32))
    np.testing.assert_array_equal(native.pointwise("NotEqual", a, b).numpy(),
                                  (an != bn).astype(np.float32))


@pytest.mark.parametrize("axis, x_shape, idx_shape, dtype", [
    (0, (50, 16), (1, 7), TensorProto.INT64),  # token ids into an embedding table
    (0, (50, 16), (2, 3), TensorProto.INT32),
    (1, (3, 20, 4), (5,), TensorProto.INT64),
    (0, (10, 2, 3), (), TensorProto.INT64),
])
def test_gather_by_integer_input_is_a_record(axis, x_shape, idx_shape, dtype, tmp_path):
    rng = np.random.default_rng(8)
    table = rng.standard_normal(x_shape).astype(np.float32)
    inits = [numpy_helper.from_array(table, "table")]
    nodes = [mk("Gather", ["table", "ids"], ["g"], axis=axis), mk("Neg", ["g"], ["y"])]
    model = _model(nodes, {"ids": (dtype, list(idx_shape))}, inits)
    size = x_shape[axis]
    ids = rng.integers(-size, size, idx_shape).astype(np.int64 if dtype == TensorProto.INT64
                                                      else np.int32)
    (got,), (want,), torch_ops, plan = _run(model, {"ids": ids}, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert not torch_ops and 15 in plan.kinds


def test_gather_by_integer_input_out_of_range_names_the_node(tmp_path):
    inits = [numpy_helper.from_array(np.ones((8, 4), np.float32), "table")]
    nodes = [mk("Gather", ["table", "ids"], ["y"], axis=0, name="embed")]
    model = _model(nodes, {"ids": (TensorProto.INT64, [1, 3])}, inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    ctx = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(str(path)).create_context()
    ok = np.array([[1, 2, -8]], np.int64)
    ctx.run({"ids": ok})  # traced
    np.testing.assert_array_equal(ctx.run({"ids": ok})["y"], np.ones((1, 3, 4), np.float32))
    with pytest.raises(kiln.KilnError, match=r"embed.*'ids'.*size 8"):
        ctx.run({"ids": np.array([[1, 8, 0]], np.int64)})


def test_gather_by_computed_indices_stays_torch(tmp_path):
    """Must not fire: indices computed from the input (Add) are no graph input the record can
    read: a torch record, the right rows."""
    inits = [numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    nodes = [mk("Add", ["ids", "one"], ["j"]), mk("Gather", ["table", "j"], ["y"], axis=0)]
    model = _model(nodes, {"ids": (TensorProto.INT64, [2])}, inits)
    (got,), (want,), torch_ops, _ = _run(model, {"ids": np.array([3, 0], np.int64)}, tmp_path)
    np.testing.assert_array_equal(got, want)
    assert torch_ops["Gather"] == 1
