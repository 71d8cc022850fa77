"""BuilderConfig: everything that decides how an engine is built."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from kiln.engine.profile import TUNE_AT, Profile

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")


@dataclass
class BuilderConfig:
    """How to build an engine.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        fp16, bf16, int8: precisions the builder may use in addition to FP32 (permissions,
            as in TensorRT: a layer runs in the fastest allowed precision that has a kernel).
        fp8: matrix products with constant weights run in FP8 e4m3 (``torch._scaled_mm`` on
            Hopper, emulated elsewhere), scaled from the INT8 calibration (``amax / 448``).
        tf32: allow TF32 math for FP32 layers on CUDA.
        low_precision_io: with ``fp16``/``bf16``, the model's float32 inputs and outputs take
            that precision too (trtexec's ``--inputIOFormats``/``--outputIOFormats``): callers
            pass and get FP16/BF16 tensors, and no Casts run at the edges.
        profiles: optimization profiles (min/opt/max shape per input); with none, every
            shape the model allows is accepted.
        workspace: bytes of scratch memory kernels may use (None: no limit).
        optimize: run the graph optimizer (folding, elimination, fusion).
        timing_cache: path of a timing cache file for kernel selection.
        tune: on CUDA, time the candidate kernels of every layer and keep the fastest (the
            default). False builds in seconds with each layer's first kernel (the PyTorch one,
            as TensorRT's builder optimization level 0 skips tactic timing): for an accuracy
            check or a quick smoke test, not for speed.
        tune_at: on CUDA, where in each optimization profile the kernels are timed:
            ``"all"`` (the default) at its min, opt and max shapes, each run then taking the
            kernels of the first of those at least as large as its inputs, so one
            dynamic-shape engine runs b1 and its max batch with kernels picked there;
            ``"opt"`` at its opt shapes only (TensorRT's way: a third of the tuning time).
        compile_workers: on CUDA, processes that compile the Triton candidates before they
            are timed (:mod:`kiln.builder.precompile`), each owning the candidates whose
            kernel, tactic and attributes hash to it; None (the default): 3/4 of the host's
            cores, at most 12, none below 4 cores, fewer where their copies of the weights
            would not fit in a quarter of the free device memory; 0 or 1: compile in the build
            process. Triton's compiles were 94% of a cold MobileNetV3 build on the H200 host
            (125 s cold, 8 s with Triton's cache warm: ``python -m bench.build_profile``).
        plan_margin: on CUDA, a layer keeps a kernel that runs from the engine's embedded
            binaries over a faster cuDNN one when it is at most this fraction slower (0.25:
            25%). cuDNN makes a plan per layer shape at an engine's first run (milliseconds
            each); kernels that don't make an engine's load + first inference fast. The same
            margin applies to the engine as a whole, per CUDA library (cuDNN, cuBLAS, PyTorch's
            SDPA kernels): the layers that picked one keep it only if together they save more
            than this fraction of the tuned layers' time (a fresh process pays a library's
            initialisation once, at its first use: 0.1-1.2 s on the H200, measured by
            ``python -m bench.cold_parts``). 0 keeps the fastest kernel everywhere.
        plan_payback: on CUDA, the number of inferences over which a library's one-time cost
            is weighed (default 1000): where a library kernel saves more per run than the
            library's start-up (or, per layer, a cuDNN plan) divided by this many runs, it is
            kept whatever ``plan_margin`` says, so large-batch engines run the fastest kernels
            (BERT-base at b64: cuBLAS saves ~0.5 ms a run, its 170 ms start-up is paid back in
            340 runs) while small ones keep a fast first run. 0: ``plan_margin`` alone.
        calib: INT8 calibration data: a folder of .npz/.npy batches, a Python file defining
            ``batches()``, or an iterable of ``{input name: array}`` (see
            :mod:`kiln.passes.quantize.data`).
        calibrator: ``"auto"`` (default: min-max for the inputs of matrix products,
            entropy for the rest, as TensorRT recommends for NLP and CNN networks),
            ``"entropy"`` (TensorRT's EntropyCalibrator2), ``"percentile"`` (99.99) or
            ``"minmax"``.
        int8_asymmetric: activations get asymmetric INT8 ranges ``[min, max]`` clipped to
            the calibrated ``amax`` (twice the resolution for GELU/ReLU outputs; None, the
            default: on for INT8, off for FP8; False: TensorRT's symmetric
            ``[-amax, amax]``); the cache then carries zero
            points (a kiln extension of TensorRT's format).
        int8_smoothing: SmoothQuant's alpha for the LayerNorm outputs that INT8 matrix
            products read (:mod:`kiln.passes.quantize.smooth`; default 0.5, 0: off).
        qdq_shared_int8: in a QDQ model, a Q/DQ pair read both by layers with constant
            weights and by other ops (a LayerNorm output that feeds Q, K and V and the
            residual Add) makes those layers INT8 too, on the pair's codes, while the other
            readers keep the dequantized values (off by default; on
            hf_distilbert_qstatic_qdq 0.5-0.8x of onnxruntime's latency at 1 thread where the
            default is ~1.0x, and 9.6e-4 off onnxruntime's output, where onnxruntime runs those
            layers in float: within its own 9.2e-3 spread; see
            bench/results/quant-cpu-2026-12-04-s11.md).
        int8_handoff: on CUDA, a tensor that only INT8/FP8 matrix products read is written as
            their 8-bit codes by the GEMM or LayerNorm that makes it
            (:mod:`kiln.passes.quantize.handoff`); False: every 8-bit layer quantizes its
            float input itself.
        qlinear_conv_int8: onnxruntime QOperator models (QLinearConv): run the convolutions as
            kiln INT8 layers in QDQ form (bias, activation and the Q/DQ pairs between layers
            fused; on tv_resnet18_qstatic_qop ~2.3x faster at 2 threads) instead of QLinearConv's
            own steps. Off by default on the CPU: that form dequantizes ``acc * x_scale *
            w_scale`` and quantizes by ``y_scale`` in two float32 roundings where onnxruntime
            requantizes by one multiplier ``x_scale * w_scale / y_scale``, so a few codes in
            10,000 differ by one (7e-3 of ResNet-18's logits). Always on for CUDA builds.
        calib_cache: calibration cache file (TensorRT's text format): read instead of
            calibrating when it exists and matches, written after calibrating otherwise.
        layer_precision: layer name (or part of a fused name) -> ``"fp32"``, ``"fp16"``,
            ``"bf16"`` or ``"int8"``: pins the layer (``kiln build --layer-precision``).
        check_finite: after an FP16/BF16/INT8 build, run the engine once on the first
            calibration batch (or random inputs) and report the first layer whose output holds
            NaN or Inf.
        verbose: log every step (fusions, kernel choices).
    """

    device: str = "cpu"
    fp16: bool = False
    bf16: bool = False
    int8: bool = False
    fp8: bool = False
    tf32: bool = True
    low_precision_io: bool = False
    profiles: list[Profile] = field(default_factory=list)
    workspace: int | None = None
    optimize: bool = True
    timing_cache: str | None = None
    tune: bool = True
    tune_at: str = "all"
    compile_workers: int | None = None
    plan_margin: float = 0.25
    plan_payback: int = 1000
    cuda_graph: bool = True
    calib: object = None
    calibrator: str = "auto"
    calib_cache: str | None = None
    int8_asymmetric: bool | None = None
    int8_smoothing: float = 0.5
    qdq_shared_int8: bool = False
    int8_handoff: bool = True
    qlinear_conv_int8: bool = False
    layer_precision: dict[str, str] = field(default_factory=dict)
    check_finite: bool = True
    verbose: bool = False

    def __post_init__(self):
        self.profiles = list(self.profiles or [])  # None: no profiles, as the default
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.low_precision_io and not (self.fp16 or self.bf16):
            raise ValueError("low_precision_io needs fp16 or bf16 (it gives the model's float32 "
                             "inputs and outputs that precision)")

        from kiln.passes.quantize.calibrate import CALIBRATORS

        if not 0.0 <= self.int8_smoothing <= 1.0:
            raise ValueError(f"int8_smoothing is SmoothQuant's alpha, in [0, 1] (0: off), not "
                             f"{self.int8_smoothing!r}")
        if self.calibrator not in CALIBRATORS:
            raise ValueError(f"calibrator must be one of {sorted(CALIBRATORS)}, "
                             f"not {self.calibrator!r}")
        bad = {k: v for k, v in self.layer_precision.items() if v not in PRECISIONS}
        if bad:
            raise ValueError(f"layer precision must be one of {PRECISIONS}: {bad}")
        if self.compile_workers is not None and not 0 <= self.compile_workers <= 256:
            raise ValueError(f"compile_workers must be between 0 and 256 (None: automatic), "
                             f"not {self.compile_workers!r}")
        if self.tune_at not in TUNE_AT:
            raise ValueError(f"tune_at must be one of {TUNE_AT}, not {self.tune_at!r}")
        if not isinstance(self.plan_payback, int) or self.plan_payback < 0:
            raise ValueError(f"plan_payback must be a whole number of runs >= 0 (0: plan_margin "
                             f"alone), not {self.plan_payback!r}")
        if not 0.0 <= self.plan_margin <= 10.0:
            raise ValueError(f"plan_margin must be a fraction between 0 and 10 (0.25: 25%), "
                             f"not {self.plan_margin!r}")

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["profiles"] = [p.to_json() for p in self.profiles]
        d["layer_precision"] = dict(self.layer_precision)
        d["calib"] = str(self.calib) if isinstance(self.calib, (str, Path)) else (
            None if self.calib is None else "<iterable>")
        return d
