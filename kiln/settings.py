"""Process-wide settings read from ``KILN_*`` environment variables, in this one place.

- ``KILN_CPU_LINEAR``: force one CPU GEMM tactic (``linear``, ``mkl``, ``onednn``,
  ``onednn_fused``) instead of timing them at the first run; for repeatable A/B measurements.
- ``KILN_CUDNN_BENCHMARK``: ``0`` turns cuDNN's per-shape autotuning off on CUDA engines (its
  heuristic picks the convolution algorithms; no timing at the first run of a shape).
- ``KILN_CACHE_DIR``: where kiln.zoo caches exported models (read by ``kiln.zoo.cache_dir``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    cpu_linear: str = ""
    cudnn_benchmark: bool = True

    @classmethod
    def from_env(cls, env=None) -> Settings:
        env = os.environ if env is None else env
        return cls(cpu_linear=env.get("KILN_CPU_LINEAR", ""),
                   cudnn_benchmark=env.get("KILN_CUDNN_BENCHMARK", "1") != "0")


SETTINGS = Settings.from_env()
