"""CPU engines keep freed activation memory for the next run (kiln.runtime.host)."""

import json
import os
import subprocess
import sys

import pytest

# In a fresh process: whether a 30 MB and a 64 MB tensor come from the heap (glibc's default
# serves each with its own mmap), then a run's worth of large activations (4 x 10 MB) all freed
# at the end, eight times over, with the page faults of each round.
CHILD = r'''
import json, resource, sys
import numpy as np, torch
import kiln
from tests.engine.models import mlp
if sys.argv[1] == "context":
    eng = kiln.Builder(kiln.BuilderConfig()).build(mlp())
    eng.create_context()
def in_heap(ptr):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False
big = torch.empty(7_500_000)
huge = torch.empty(16_000_000)  # 64 MB: above the largest mmap threshold glibc takes
from_heap = [in_heap(big.data_ptr()), in_heap(huge.data_ptr())]
del big, huge
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
for _ in range(8):
    f0 = faults()
    xs = [torch.empty(2_500_000).fill_(1.0) for _ in range(4)]
    del xs
    rounds.append(faults() - f0)
from kiln.runtime import host
print(json.dumps({"rounds": rounds, "kept": host._done, "from_heap": from_heap}))
'''


def _rounds(mode: str, **env) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=root,
                       env=dict(os.environ, PYTHONPATH=root, **env), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_context_keeps_freed_memory_for_the_next_run():
    kept = _rounds("context")
    assert kept["kept"] is True and kept["from_heap"] == [True, True], kept
    assert max(kept["rounds"][3:]) < 50, kept  # once the heap holds a round, none fault


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("mode,env", [("none", {}), ("context", {"KILN_CPU_KEEP_MEMORY": "0"})],
                         ids=["no-context", "turned-off"])
def test_malloc_is_left_alone_without_a_cpu_context_or_when_turned_off(mode, env):
    plain = _rounds(mode, **env)
    assert plain["kept"] is (None if mode == "none" else False), plain
    assert plain["from_heap"] == [False, False], plain  # glibc's default: each is its own mmap


# ---------------------------------------------------------------- engine-file weight pages

def _mapping_rss_kib(addr: int) -> int:
    """Resident KiB of the mapping that holds ``addr`` (from /proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            inside = lo <= addr < hi
        elif inside and head[0] == "Rss:":
            return int(head[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, /proc/self/smaps")
def test_release_pages_of_an_engine_weight_keeps_its_values(tmp_path):
    import gc

    import numpy as np
    import torch

    from kiln.engine import format as fmt
    from kiln.runtime import host

    w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    path = tmp_path / "w.kiln"
    fmt.write_engine(path, {"plan": {}}, {"w": w, "small": np.ones(3, np.float32)})
    ef = fmt.read_engine(path)  # the checksum read every page: all resident
    t = torch.from_numpy(ef.tensors["w"])
    before = _mapping_rss_kib(t.data_ptr())
    assert before >= w.nbytes // 1024
    released = host.release_pages(t)
    assert released >= w.nbytes - 2 * 4096  # every page wholly inside the weight
    assert _mapping_rss_kib(t.data_ptr()) <= before - released // 1024 + 8
    np.testing.assert_array_equal(t.numpy(), w)  # read again, from the file, unchanged
    np.testing.assert_array_equal(ef.tensors["small"], np.ones(3, np.float32))

    # memory that is not an engine-file mapping is never touched
    anon = torch.randn(512, 1024)
    copy = anon.clone()
    assert host.release_pages(anon) == 0 and torch.equal(anon, copy)

    # once the mapping is gone (its last array dropped), its range is forgotten
    start = next(lo for lo, hi in host._mappings if lo <= t.data_ptr() < hi)
    del t, ef
    gc.collect()
    assert all(lo != start for lo, _ in host._mappings)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, /proc/self/smaps")
def test_cpu_engine_gives_back_the_file_pages_of_packed_weights(tmp_path, monkeypatch):
    import numpy as np
    import torch

    import kiln
    from kiln.kernels.torch import fused_conv as FCK
    from tests.engine.models import mlp, mlp_reference

    if not FCK._HAVE_ONEDNN:
        pytest.skip("needs oneDNN's packed linear")
    monkeypatch.setattr(FCK, "_FORCED", "onednn")  # a packed tactic, not plain F.linear
    model = mlp(hidden=65536)  # w1: 8 x 65536 floats, 2 MiB
    path = tmp_path / "m.kiln"
    kiln.Builder(kiln.BuilderConfig()).build(model).save(path)
    eng = kiln.load(path)
    ctx = eng.create_context()
    w1 = next(c for _, c in eng._executor.consts if tuple(c.shape) == (8, 65536))
    before = _mapping_rss_kib(w1.data_ptr())
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    for _ in range(2):
        y = ctx.run({"x": x})["y"]
        np.testing.assert_allclose(y, mlp_reference(x, model), rtol=1e-4, atol=1e-3)
    assert _mapping_rss_kib(w1.data_ptr()) <= before - 1900  # w1's ~2 MiB went
    assert isinstance(w1, torch.Tensor)
