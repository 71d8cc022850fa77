"""Embedded Triton binaries (kiln.kernels.triton.binary): call keys, routing, the engine file
section, and (on a GPU) an engine that loads and runs in a fresh process with nothing compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.kernels.triton import binary
from kiln.kernels.triton.norm import _norm_kernel
from kiln.kernels.triton.softmax import _softmax_kernel

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _key(*args, kernel=_norm_kernel, **kw):
    return binary.call_key(kernel, args, kw)


def test_call_key_follows_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float16)
    base = _key(x, x, x, x, 32, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64, ONE_BLOCK=True,
                num_warps=2)
    same = _key(torch.ones(64, dtype=torch.float16), x, x, x, 48, 32, 64, 3e-1, HAS_B=True,
                RMS=False, BLOCK=64, ONE_BLOCK=True, num_warps=2)
    assert base == same  # other data, another multiple of 16, another float: same binary
    variants = [
        _key(x.float(), x, x, x, 32, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64,
             ONE_BLOCK=True, num_warps=2),  # dtype
        _key(x[1:], x, x, x, 32, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64,
             ONE_BLOCK=True, num_warps=2),  # 16-byte alignment of a pointer
        _key(x, x, x, x, 1, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64,
             ONE_BLOCK=True, num_warps=2),  # an int equal to 1
        _key(x, x, x, x, 33, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64,
             ONE_BLOCK=True, num_warps=2),  # not a multiple of 16
        _key(x, x, x, x, 2**40, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64,
             ONE_BLOCK=True, num_warps=2),  # 64-bit int
        _key(x, x, x, x, 32, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=128,
             ONE_BLOCK=True, num_warps=2),  # a constexpr's value
        _key(x, x, x, x, 32, 32, 64, 1e-5, HAS_B=True, RMS=False, BLOCK=64,
             ONE_BLOCK=True, num_warps=4),  # a launch option
        _key(x, x, 32, 32, 64, False, kernel=_softmax_kernel),  # another kernel
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_positional_constexprs_are_keyed_by_value():
    x = torch.zeros(8)
    # X, W, B, Y, R, Q, QM, three strides, n_cols, eps, zshift, then HAS_B, RMS, BLOCK...
    k1 = _key(x, x, x, x, x, x, x, 16, 16, 16, 16, 1e-5, 0, True, False, 64, True)
    k2 = _key(x, x, x, x, x, x, x, 16, 16, 16, 16, 1e-5, 0, True, False, 128, True)
    assert k1 != k2


def test_launch_routes_a_known_call_to_its_binary(monkeypatch):
    x = torch.zeros(16)
    args = (x, x, x, x, 16, 16, 16, 1e-5)
    kw = dict(HAS_B=True, RMS=False, BLOCK=16, ONE_BLOCK=True, num_warps=1)
    calls = []
    fake = binary.Binary(name="k", cubin=b"", num_warps=1, shared=0, args=[])
    monkeypatch.setattr(binary.Binary, "launch",
                        lambda self, kernel, grid, a, k: calls.append((kernel, grid, a, k)))
    binary.clear()
    try:
        binary.install({binary.call_key(_norm_kernel, args, kw): fake})
        binary.launch(_norm_kernel, (1,), *args, **kw)
        assert calls == [(_norm_kernel, (1,), args, kw)]
    finally:
        binary.clear()


def test_pack_unpack_round_trip_and_usability():
    pytest.importorskip("triton")
    b = binary.Binary(name="kern", cubin=bytes(range(200)), num_warps=4, shared=1024,
                      args=[("X", "*fp16"), ("n", "i32"), ("B", "constexpr")])
    tensors: dict = {}
    section = binary.pack({"key-a": b}, tensors)
    section = json.loads(json.dumps(section))  # what the header holds
    back = binary.unpack(section, tensors)
    assert list(back) == ["key-a"]
    got = back["key-a"]
    assert (got.name, got.cubin, got.num_warps, got.shared, got.args) == (
        b.name, b.cubin, b.num_warps, b.shared, b.args)
    if binary.triton_abi() is not None:
        assert binary.usable(section) is None
    assert "sources differ" in binary.usable(dict(section, digest="other"))
    with pytest.raises(KeyError):
        binary.unpack({"kernels": [dict(section["kernels"][0], tensor="missing")]}, tensors)


def _norm_softmax_model():
    """LayerNorm over 64 features, then Softmax: two Triton kernels on CUDA."""
    rng = np.random.default_rng(0)
    g = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "g")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], name="ln", axis=-1),
             helper.make_node("Softmax", ["n"], ["y"], name="sm", axis=-1)]
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64])], [g, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


_CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import kiln
    from kiln.kernels.triton import binary
    e = kiln.load(sys.argv[1])
    x = np.load(sys.argv[2])
    y = e.create_context().run({"x": x})["y"]
    np.save(sys.argv[3], y)
    print(json.dumps({"installed": binary.installed(), "note": e.binaries_note,
                      "triton_imported": "triton" in sys.modules}))
""")


@gpu
@needs_cuda
def test_engine_runs_from_its_binaries_in_a_fresh_process(tmp_path):
    cfg = kiln.BuilderConfig(device="cuda", fp16=True,
                             profiles=[kiln.Profile.fixed({"x": (256, 64)})])
    builder = kiln.Builder(cfg)
    engine = builder.build(_norm_softmax_model())
    if binary.triton_abi() is None:
        pytest.skip("kiln does not know this Triton's launch convention")
    if not any(c.startswith("Triton") for c in engine.choices.values()):
        pytest.skip("the autotuner picked no Triton kernel for this model here")
    assert engine.binaries, builder.report.get("binaries")
    path = tmp_path / "m.kiln"
    engine.save(path)
    x = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)
    want = engine.create_context(cuda_graph=False).run({"x": x})["y"]
    np.save(tmp_path / "x.npy", x)
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    p = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tmp_path / "x.npy"),
                        str(tmp_path / "y.npy")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["installed"] == len(engine.binaries) and not info["note"]
    assert not info["triton_imported"]  # load + first run: the binaries need no Triton
    assert list(cache.rglob("*")) == []  # Triton compiled nothing and looked up nothing
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-3, atol=1e-4)
