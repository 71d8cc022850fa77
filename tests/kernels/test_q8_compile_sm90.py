"""The INT8/FP8 Triton kernels compile for sm90 (H100/H200) on a machine without a GPU, and the
GEMM and conv forms become pipelined wgmma kernels (tests/kernels/q8_compile_check.py, in a
fresh process where Triton compiles instead of interpreting)."""

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
    p = subprocess.run([sys.executable, "-m", "tests.kernels.q8_compile_check"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]


def test_every_form_compiles(rows):
    assert len(rows) == 13
    bad = [r for r in rows if "error" in r]
    assert not bad, bad


def test_gemm_and_conv_are_pipelined_wgmma(rows):
    for r in rows:
        if r["kernel"] in ("gemm", "conv"):
            assert r["wgmma"] and r["pipelined"], r
