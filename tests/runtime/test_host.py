"""CPU engines keep freed activation memory for the next run (kiln.runtime.host)."""

import json
import os
import subprocess
import sys

import pytest

# A run's worth of large activations (4 x 10 MB, above glibc's adaptive mmap threshold once it
# settles), all freed at the end, eight times over; prints the page faults of each round.
# In a fresh process: whether a 30 MB tensor comes from the heap (glibc's default serves it with
# its own mmap), then a run's worth of large activations (4 x 10 MB) all freed at the end,
# eight times over, with the page faults of each round.
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
from_heap = in_heap(big.data_ptr())
del big
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
    assert kept["kept"] is True and kept["from_heap"], kept
    assert max(kept["rounds"][3:]) < 50, kept  # once the heap holds a round, none fault


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("mode,env", [("none", {}), ("context", {"KILN_CPU_KEEP_MEMORY": "0"})],
                         ids=["no-context", "turned-off"])
def test_malloc_is_left_alone_without_a_cpu_context_or_when_turned_off(mode, env):
    plain = _rounds(mode, **env)
    assert plain["kept"] is (None if mode == "none" else False), plain
    assert not plain["from_heap"], plain  # glibc's default: a block this large is its own mmap
