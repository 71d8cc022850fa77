"""BuilderConfig: everything that decides how an engine is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kiln.engine.profile import Profile


@dataclass
class BuilderConfig:
    """How to build an engine.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        fp16, bf16, int8: precisions the builder may use in addition to FP32 (permissions,
            as in TensorRT: a layer runs in the fastest allowed precision that has a kernel).
        tf32: allow TF32 math for FP32 layers on CUDA.
        low_precision_io: with ``fp16``/``bf16``, the model's float32 inputs and outputs take
            that precision too (trtexec's ``--inputIOFormats``/``--outputIOFormats``): callers
            pass and get FP16/BF16 tensors, and no Casts run at the edges.
        profiles: optimization profiles (min/opt/max shape per input); with none, every
            shape the model allows is accepted.
        workspace: bytes of scratch memory kernels may use (None: no limit).
        optimize: run the graph optimizer (folding, elimination, fusion).
        timing_cache: path of a timing cache file for kernel selection.
        plan_margin: on CUDA, a layer keeps a kernel that runs from the engine's embedded
            binaries over a faster cuDNN one when it is at most this fraction slower (0.25:
            25%). cuDNN makes a plan per layer shape at an engine's first run (milliseconds
            each); kernels that don't make an engine's load + first inference fast. 0 keeps
            the fastest kernel everywhere.
        verbose: log every step (fusions, kernel choices).
    """

    device: str = "cpu"
    fp16: bool = False
    bf16: bool = False
    int8: bool = False
    tf32: bool = True
    low_precision_io: bool = False
    profiles: list[Profile] = field(default_factory=list)
    workspace: int | None = None
    optimize: bool = True
    timing_cache: str | None = None
    plan_margin: float = 0.25
    cuda_graph: bool = True
    verbose: bool = False

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.low_precision_io and not (self.fp16 or self.bf16):
            raise ValueError("low_precision_io needs fp16 or bf16 (it gives the model's float32 "
                             "inputs and outputs that precision)")

        if not 0.0 <= self.plan_margin <= 10.0:
            raise ValueError(f"plan_margin must be a fraction between 0 and 10 (0.25: 25%), "
                             f"not {self.plan_margin!r}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["profiles"] = [p.to_json() for p in self.profiles]
        return d
