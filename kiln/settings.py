"""Process-wide settings read from ``KILN_*`` environment variables, in this one place.

- ``KILN_CPU_LINEAR``: force one CPU GEMM tactic (``linear``, ``mkl``, ``onednn``,
  ``onednn_fused``) instead of timing them at the first run; for repeatable A/B measurements.
- ``KILN_CACHE_DIR``: where kiln.zoo caches exported models (read by ``kiln.zoo.cache_dir``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    cpu_linear: str = ""

    @classmethod
    def from_env(cls, env=None) -> Settings:
        env = os.environ if env is None else env
        return cls(cpu_linear=env.get("KILN_CPU_LINEAR", ""))


SETTINGS = Settings.from_env()
