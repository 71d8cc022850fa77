"""Process-wide settings read from ``KILN_*`` environment variables, in this one place.

- ``KILN_CPU_LINEAR``: force one CPU GEMM tactic (``linear``, ``mkl``, ``onednn``,
  ``onednn_fused``, ``kiln``) instead of timing them at the first run; for repeatable A/B
  measurements.
- ``KILN_CPU_CONV``: force one CPU convolution tactic (``onednn``, or ``kiln``: kiln's own
  kernel where one applies, oneDNN elsewhere) instead of timing them at the first run.
- ``KILN_CUDNN_BENCHMARK``: ``1`` turns cuDNN's per-shape autotuning on for CUDA engines. Off by
  default: the builder times convolutions with cuDNN's heuristic algorithm choice (what an engine
  then runs), and autotuning at the first run of each shape costs about a second on ResNet-50
  (H200: first inference 0.84 s with it, 0.40 s without; steady state within 2%).
- ``KILN_CPU_CHAINS``: ``0`` turns native chains off (:mod:`kiln.engine.chains`): CPU engines
  then run every step on its own.
- ``KILN_CPU_PROGRAM``: ``0`` turns native programs off (:mod:`kiln.engine.program`): the
  executor's Python loop then walks the steps.
- ``KILN_CPU_KEEP_MEMORY``: ``0`` leaves glibc's malloc as it is. By default CPU engines make it
  keep freed memory for the next run instead of returning it to the OS (see
  :mod:`kiln.runtime.host`).
- ``KILN_CUDA_MATMUL_NORM``: ``1`` lets CUDA builds fuse a product and the LayerNorm that
  alone reads it (``FusedMatMulLayerNorm``: BERT's post-norm blocks, the norm kernel adding
  the residual). Off by default until its kernel's GPU test has a clean run on the H200 (see
  :mod:`kiln.passes.pipeline`); CPU builds fuse them always.
- ``KILN_CACHE_DIR``: where kiln.zoo caches exported models (read by ``kiln.zoo.cache_dir``).
- ``KILN_OMP_PASSIVE``: ``0`` leaves OpenMP's wait policy as it is. By default ``import kiln``
  sets ``OMP_WAIT_POLICY=PASSIVE`` when neither it nor ``GOMP_SPINCOUNT`` is set and torch (whose
  libgomp reads them once, when it is loaded) is not imported yet: see
  :func:`apply_omp_wait_policy`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# the variables that set how long an idle OpenMP thread spins before it sleeps
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# what apply_omp_wait_policy found: "kiln" (it set PASSIVE), "user" (the environment set one),
# "off" (KILN_OMP_PASSIVE=0), "late" (torch was imported first: its libgomp spins, the default)
omp_wait_policy_source = ""


@dataclass(frozen=True)
class Settings:
    cpu_linear: str = ""
    cpu_conv: str = ""
    cudnn_benchmark: bool = False
    cpu_keep_memory: bool = True
    cpu_chains: bool = True
    cpu_program: bool = True
    cuda_matmul_norm: bool = False

    @classmethod
    def from_env(cls, env=None) -> Settings:
        env = os.environ if env is None else env
        return cls(cpu_linear=env.get("KILN_CPU_LINEAR", ""),
                   cpu_conv=env.get("KILN_CPU_CONV", ""),
                   cudnn_benchmark=env.get("KILN_CUDNN_BENCHMARK", "0") == "1",
                   cpu_keep_memory=env.get("KILN_CPU_KEEP_MEMORY", "1") != "0",
                   cpu_chains=env.get("KILN_CPU_CHAINS", "1") != "0",
                   cpu_program=env.get("KILN_CPU_PROGRAM", "1") != "0",
                   cuda_matmul_norm=env.get("KILN_CUDA_MATMUL_NORM", "0") == "1")


SETTINGS = Settings.from_env()


def apply_omp_wait_policy(env=None, modules=None) -> str:
    """Make OpenMP's idle threads sleep instead of spin, unless the user chose otherwise.

    libgomp (torch's OpenMP runtime, which kiln's C kernels share) lets a thread that finished
    its part of a parallel region spin for ~300,000 pauses (milliseconds) before it sleeps. On an
    idle machine that saves a wake-up; on cores shared with other work the spinning thread holds a
    core the caller needs and the next region waits for a descheduled thread: measured on this
    2-core VM at load average ~4, ``tv_mobilenet_v3_small`` 264-508 ms with the default against
    13-26 ms with ``OMP_WAIT_POLICY=PASSIVE`` (onnxruntime 17 ms; its pool spins briefly and its
    caller does the work of threads that are not running). libgomp reads the policy once, when it
    is loaded (``import torch``), so this only helps where kiln is imported first. Returns (and
    keeps in :data:`omp_wait_policy_source`) what it found: ``kiln``, ``user``, ``off``, ``late``.
    """
    global omp_wait_policy_source
    env = os.environ if env is None else env
    modules = sys.modules if modules is None else modules
    if env.get("KILN_OMP_PASSIVE", "1") == "0":
        found = "off"
    elif any(env.get(k) for k in OMP_WAIT_VARS):
        found = "user"
    elif "torch" in modules:
        found = "late"
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        found = "kiln"
    omp_wait_policy_source = found
    return found


_warned = False


def warn_if_spinning() -> bool:
    """Warn once per process (a RuntimeWarning) where kiln runs CPU work on several threads
    and torch's libgomp was loaded with its spinning default because torch was imported before
    kiln; returns whether it warned."""
    global _warned
    if _warned or omp_wait_policy_source != "late":
        return False
    import torch

    if torch.get_num_threads() < 2:
        return False
    _warned = True
    import warnings

    warnings.warn("torch was imported before kiln and OMP_WAIT_POLICY is not set: OpenMP's idle "
                  "threads spin, which makes kiln's CPU runs many times slower on cores shared "
                  "with other work. Import kiln before torch, or set OMP_WAIT_POLICY=PASSIVE "
                  "(or ACTIVE, to keep spinning and silence this) in the environment",
                  RuntimeWarning, stacklevel=3)
    return True


apply_omp_wait_policy()  # on import: kiln/__init__.py imports this module before torch
