"""The CUDA runtime. CPU-side tests (placement through the meta device, the load-time device
check, the bench breakdown) run everywhere; the rest is marked ``gpu`` and skipped without one."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.cli.bench import gpu_breakdown
from kiln.engine.executor import Executor
from kiln.errors import EngineFileError
from kiln.frontend import import_onnx
from kiln.perf.timing import Record
from kiln.runtime import cuda as rt_cuda
from tests.engine.models import mlp, mlp_reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _placement_model():
    """ids + one (int64[1]) -> a; f * w (float[3]) -> z; Reshape(z, Shape(f)) -> r."""
    one = numpy_helper.from_array(np.array([1], np.int64), "one")
    w = numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "w")
    nodes = [helper.make_node("Add", ["ids", "one"], ["a"], name="add"),
             helper.make_node("Mul", ["f", "w"], ["z"], name="mul"),
             helper.make_node("Shape", ["f"], ["s"], name="shape"),
             helper.make_node("Reshape", ["z", "s"], ["r"], name="reshape")]
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [3]),
                          helper.make_tensor_value_info("f", TensorProto.FLOAT, [3])],
                  [helper.make_tensor_value_info("a", TensorProto.INT64, [3]),
                   helper.make_tensor_value_info("r", TensorProto.FLOAT, [3])], [one, w])


# ---- CPU-side ----------------------------------------------------------------------------------

def test_executor_places_constants_by_kind():
    """The meta device stands in for a GPU: it fails on mixed devices just as CUDA does."""
    graph = import_onnx(_placement_model())
    ex = Executor(graph, "cpu", device=torch.device("meta"))
    # the executor lists the weights' constants first, in the graph's order
    homes = {v.name: c.device.type for v, (_, c) in zip(graph.weights.values(), ex.consts)}
    assert homes == {"one": "cpu", "w": "meta"}
    assert ex.device_weight_bytes == 12


def test_executor_uploads_host_inputs_a_kernel_needs_and_remembers():
    graph = import_onnx(_placement_model())
    ex = Executor(graph, "cpu", device=torch.device("meta"))
    args = [torch.zeros(3, dtype=torch.int64, device="meta"), torch.zeros(3, device="meta")]
    a, r = ex.run(args)
    assert a.device.type == r.device.type == "meta"
    steps = {st.node.name: st for st in ex.steps}
    assert steps["add"].upload == (1,)  # the int64[1] constant had to go up
    assert steps["reshape"].upload == ()  # the shape vector stayed on the host
    assert len(ex._device_consts) == 1
    calls = []
    fn = steps["add"].fn
    steps["add"].fn = lambda call, *xs: calls.append(xs) or fn(call, *xs)
    ex.run(args)
    assert len(calls) == 1 and calls[0][1].device.type == "meta"  # no second failure


def test_executor_reports_kernel_errors_that_are_not_about_devices():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")]
    shape = numpy_helper.from_array(np.array([5], np.int64), "shape")
    graph = import_onnx(_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                      [4])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                               [shape]))
    ex = Executor(graph, "cpu", device=torch.device("meta"))
    with pytest.raises(kiln.KernelError, match="bad_reshape"):
        ex.run([torch.zeros(4, device="meta")])
    assert ex.steps[0].upload == ()


def _pretend_gpu(monkeypatch, **here):
    fp = {"kind": "cuda", "name": "NVIDIA H200", "capability": [9, 0], "cuda_version": "13.0",
          "torch_version": "2.11.0", "triton_version": "3.6.0"}
    fp.update(here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rt_cuda, "fingerprint", lambda kind: dict(fp))


BUILT = {"kind": "cuda", "name": "NVIDIA H200", "capability": [9, 0], "cuda_version": "13.0",
         "torch_version": "2.11.0", "triton_version": "3.6.0"}


def test_load_check_accepts_the_same_gpu(monkeypatch):
    _pretend_gpu(monkeypatch)
    assert rt_cuda.check_device(BUILT, "m.kiln") == []


def test_load_check_refuses_another_gpu_naming_both(monkeypatch):
    _pretend_gpu(monkeypatch, name="NVIDIA A100-SXM4-80GB", capability=[8, 0])
    with pytest.raises(EngineFileError) as e:
        rt_cuda.check_device(BUILT, "m.kiln")
    msg = str(e.value)
    assert "NVIDIA H200" in msg and "A100" in msg and "capability" in msg
    assert "kiln build --device cuda" in msg and "portable=True" in msg


def test_load_check_refuses_other_versions_unless_portable(monkeypatch):
    _pretend_gpu(monkeypatch, torch_version="2.12.0")
    with pytest.raises(EngineFileError, match="torch version"):
        rt_cuda.check_device(BUILT, "m.kiln")
    notes = rt_cuda.check_device(BUILT, "m.kiln", portable=True)
    assert len(notes) == 1 and "2.12.0" in notes[0]


def test_load_check_without_cuda_says_rebuild_for_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineFileError, match="--device cpu"):
        rt_cuda.check_device(BUILT, "m.kiln")
    assert rt_cuda.check_device({"kind": "cpu", "name": "x86_64"}, "m.kiln") == []


def test_bench_gpu_breakdown_skips_warmup_and_fills_enqueue():
    records = [Record(0, 0.0, 1.0), Record(1, 0.1, 1.1), Record(0, 1.0, 2.0)]
    times = [[{"enqueue_s": 9.0, "h2d_ms": 9.0, "compute_ms": 9.0, "d2h_ms": 9.0}]  # warm-up
             + [{"enqueue_s": 0.5e-3 * k, "h2d_ms": 0.1, "compute_ms": 1.0 * k, "d2h_ms": 0.2}
                for k in (1, 2)],
             [{"enqueue_s": 1e-3, "h2d_ms": 0.1, "compute_ms": 3.0, "d2h_ms": 0.2}]]
    gpu = gpu_breakdown(records, times)
    assert [r.enqueue for r in records] == [0.5e-3, 1e-3, 1e-3]
    assert gpu["compute_ms"]["max"] == 3.0 and gpu["compute_ms"]["min"] == 1.0
    assert gpu["h2d_ms"]["median"] == pytest.approx(0.1)


def test_cuda_engine_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(kiln.KilnError, match="no CUDA device"):
        kiln.Builder(kiln.BuilderConfig(device="cuda")).build(mlp())


# ---- on a GPU ----------------------------------------------------------------------------------

def _cuda_engine(model=None, **cfg):
    return kiln.Builder(kiln.BuilderConfig(device="cuda", **cfg)).build(model or mlp())


@gpu
@needs_cuda
def test_cuda_numpy_in_numpy_out_and_graph_replay():
    model = mlp()
    ctx = _cuda_engine(model, tf32=False).create_context()
    rng = np.random.default_rng(0)
    for _ in range(3):  # run 1 eager + capture, runs 2-3 replay with new data
        x = rng.standard_normal((4, 8)).astype(np.float32)
        y = ctx.run({"x": x})["y"]
        assert isinstance(y, np.ndarray) and y.dtype == np.float32
        np.testing.assert_allclose(y, mlp_reference(x, model), rtol=1e-4, atol=1e-4)
    assert list(ctx.cuda.decisions.values()) == ["cuda graph"]
    ctx.run({"x": rng.standard_normal((2, 8)).astype(np.float32)})  # a second signature
    assert len(ctx.cuda.decisions) == 2


@gpu
@needs_cuda
def test_cuda_torch_in_torch_out_on_callers_device():
    ctx = _cuda_engine(tf32=False).create_context()
    x = torch.randn(3, 8)
    for _ in range(2):
        y_dev = ctx.run({"x": x.cuda()})["y"]
        y_cpu = ctx.run({"x": x})["y"]
    assert y_dev.device.type == "cuda" and y_cpu.device.type == "cpu"
    y_first = y_dev
    y_second = ctx.run({"x": (2 * x).cuda()})["y"]  # replays must not overwrite earlier results
    assert not torch.equal(y_first, y_second)
    torch.testing.assert_close(y_dev.cpu(), y_cpu, rtol=1e-4, atol=1e-4)


@gpu
@needs_cuda
def test_cuda_outputs_without_copy_are_the_graph_buffers():
    ctx = _cuda_engine(tf32=False).create_context()
    x = torch.randn(3, 8, device="cuda")
    want = ctx.run({"x": x.cpu()})["y"]
    a = ctx.run({"x": x}, copy_outputs=False)["y"]
    torch.testing.assert_close(a.cpu(), want, rtol=1e-4, atol=1e-4)
    b = ctx.run({"x": 2 * x}, copy_outputs=False)["y"]
    assert a.data_ptr() == b.data_ptr()  # one buffer, overwritten by the next run
    c = ctx.run({"x": x})["y"]  # the default: a copy the next run leaves alone
    assert c.data_ptr() != b.data_ptr()
    torch.testing.assert_close(c.cpu(), want, rtol=1e-4, atol=1e-4)


@gpu
@needs_cuda
def test_cuda_graphs_off_runs_eagerly():
    engine = _cuda_engine(cuda_graph=False)
    ctx = engine.create_context()
    x = np.ones((2, 8), np.float32)
    a, b = ctx.run({"x": x})["y"], ctx.run({"x": x})["y"]
    np.testing.assert_array_equal(a, b)
    assert list(ctx.cuda.decisions.values()) == ["eager: CUDA graphs are off"]


@gpu
@needs_cuda
def test_cuda_capture_failure_falls_back_to_eager():
    """TopK reads k with .tolist(): a host sync, which capture refuses."""
    nodes = [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                           helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                   [helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    ctx = _cuda_engine(model).create_context()
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    for k in (2, 3):
        v = ctx.run({"x": x, "k": np.array([k], np.int64)})["v"]
        np.testing.assert_array_equal(v, np.sort(x, axis=1)[:, ::-1][:, :k])
    (why,) = ctx.cuda.decisions.values()
    assert why.startswith("eager: ")


@gpu
@needs_cuda
def test_cuda_data_dependent_ops_are_never_captured():
    nodes = [helper.make_node("NonZero", ["x"], ["y"], name="nz")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
                   [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    ctx = _cuda_engine(model).create_context()
    y = ctx.run({"x": np.array([0, 1, 0, 2, 3], np.float32)})["y"]
    np.testing.assert_array_equal(y, [[1, 3, 4]])
    assert "data-dependent" in next(iter(ctx.cuda.decisions.values()))


@gpu
@needs_cuda
def test_cuda_fp16_matches_fp32():
    model = mlp(hidden=64)
    x = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    ctx = _cuda_engine(model, fp16=True).create_context()
    for _ in range(2):
        y = ctx.run({"x": x})["y"]
    ref = mlp_reference(x, model)
    assert y.dtype == np.float32
    assert np.max(np.abs(y - ref)) / np.max(np.abs(ref)) < 1e-2


@gpu
@needs_cuda
def test_cuda_save_load_and_device_memory(tmp_path):
    engine = _cuda_engine(fp16=True)
    engine.save(tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    assert loaded.header["device"]["name"] == torch.cuda.get_device_name()
    assert loaded.portability_notes == []
    mem = loaded.device_memory()
    assert mem["weights"] == loaded._executor.device_weight_bytes > 0
    assert mem["activations"] > 0 and mem["total"] >= mem["weights"] + mem["activations"]


@gpu
@needs_cuda
def test_cuda_contexts_run_concurrently():
    model = mlp()
    engine = _cuda_engine(model, tf32=False)
    errors: list = []

    def work(seed):
        try:
            ctx = engine.create_context()
            rng = np.random.default_rng(seed)
            for _ in range(20):
                x = rng.standard_normal((seed + 1, 8)).astype(np.float32)
                np.testing.assert_allclose(ctx.run({"x": x})["y"], mlp_reference(x, model),
                                           rtol=1e-4, atol=1e-4)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
