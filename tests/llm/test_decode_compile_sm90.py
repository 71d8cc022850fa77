"""The paged decode kernels (tl.dot, its K . q^T variant, the tiled MHA kernel with and without
PREFETCH, one split writing the output) compile for sm90 on a machine without a GPU
(tests/llm/decode_compile_check.py in a fresh process, where Triton compiles instead of
interpreting: the interpreter runs code a compiled kernel refuses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows():
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "tests.llm.decode_compile_check"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]


def test_every_decode_form_compiles(rows):
    assert len(rows) == 2 * 2 * (2 * 2 + 2)
    bad = [r for r in rows if "error" in r]
    assert not bad, bad


def test_kq_takes_hopper_mma_and_dot_kernels_pipeline_their_loads(rows):
    """The K . q^T kernel's dots have TILE rows (wgmma's 64 or more), the q . K^T kernel's the
    16 padded query rows (mma.sync); both stream K/V with async copies."""
    for r in rows:
        if r["kernel"] == "kq":
            assert r["wgmma"] and r["pipelined"], r
        if r["kernel"] == "dot":
            assert r["mma"] and r["pipelined"], r
