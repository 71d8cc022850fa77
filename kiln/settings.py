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
- ``KILN_CACHE_DIR``: where kiln.zoo caches exported models (read by ``kiln.zoo.cache_dir``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    cpu_linear: str = ""
    cpu_conv: str = ""
    cudnn_benchmark: bool = False
    cpu_keep_memory: bool = True
    cpu_chains: bool = True
    cpu_program: bool = True

    @classmethod
    def from_env(cls, env=None) -> Settings:
        env = os.environ if env is None else env
        return cls(cpu_linear=env.get("KILN_CPU_LINEAR", ""),
                   cpu_conv=env.get("KILN_CPU_CONV", ""),
                   cudnn_benchmark=env.get("KILN_CUDNN_BENCHMARK", "0") == "1",
                   cpu_keep_memory=env.get("KILN_CPU_KEEP_MEMORY", "1") != "0",
                   cpu_chains=env.get("KILN_CPU_CHAINS", "1") != "0",
                   cpu_program=env.get("KILN_CPU_PROGRAM", "1") != "0")


SETTINGS = Settings.from_env()
