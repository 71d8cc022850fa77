"""The generation engine: tokenizer + scheduler + KV cache + model runner, one ``step()`` at a time.

``LLMEngine.step()`` schedules, runs the model once, samples, detokenizes and returns what each
request gained in that step (new tokens, new text, whether it finished).
"""

from __future__ import annotations

import atexit
import gc
import itertools
import time
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.llm.detokenizer import IncrementalDetokenizer
from kiln.llm.kv_cache import KVCacheManager
from kiln.llm.metrics import EngineMetrics
from kiln.llm.request import Request, Status
from kiln.llm.sampling import SamplingParams
from kiln.llm.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    Args:
        device: ``cpu`` or ``cuda`` (``auto``: CUDA when present).
        dtype: ``float32``, ``float16`` or ``bfloat16`` (``auto``: FP32 on CPU, FP16 on CUDA).
        block_size: tokens per KV-cache block.
        num_blocks: KV-cache blocks; 0 sizes the pool from ``memory_fraction``.
        memory_fraction: share of device memory for weights + cache (CUDA); on CPU, of RAM.
        max_num_seqs, max_num_batched_tokens: per-step limits of the scheduler; 0 (the
            default): by device, ``DEFAULT_LIMITS`` (CPU 64 / 2048; CUDA 256 / 8192, what an
            H200 needs to batch 256 concurrent requests and prefill 16 prompts of 512 a step).
        max_model_len: longest prompt + output (0: the model's context, capped at 4096 on CPU).
        enable_prefix_caching: reuse the KV blocks of prompts seen before.
        cuda_graphs: capture decode steps in CUDA graphs (CUDA only).
        weights: ``dtype`` (GEMM weights in ``dtype``), ``int8`` or ``int4`` (CPU, float32:
            weight-only quantized in groups of 32 with FP16 scales; the LM head in int8), or
            ``fp8`` (CUDA: every GEMM weight, the LM head included, in FP8 e4m3 with one scale
            per output channel; decode GEMVs in Triton, larger GEMMs on ``torch._scaled_mm``).
        native_decode: on the CPU, run decode-only steps as one native call per step.
        kv_cache_dtype: ``auto`` (the KV cache in ``dtype``) or ``fp8`` (= ``fp8_e4m3``: one
            byte per element, twice the blocks of FP16 in the same memory; one float32 scale
            per layer for K and for V, see ``kv_quant.py``). On the CPU it runs in torch ops
            (dequantized per step; no native decode): for tests, not for speed.
        calculate_kv_scales: FP8 KV scales from the first step's K/V amax (with 2x headroom)
            instead of 1.0.
        warmup: on CUDA, compile the step kernels and capture every decode graph size at
            load (a few seconds for a 7B model) instead of inside the first requests' steps.
    """
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int = 0
    memory_fraction: float = 0.9
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    long_prefill_token_threshold: int = 0
    weights: str = "dtype"
    native_decode: bool = True
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    warmup: bool = True


# device type -> (max_num_seqs, max_num_batched_tokens) where EngineConfig leaves them at 0
DEFAULT_LIMITS = {"cpu": (64, 2048), "cuda": (256, 8192)}


def scheduler_limits(cfg: EngineConfig, device: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for ``device`` (``cpu``/``cuda``): the config's,
    or the device's defaults where they are 0."""
    seqs, tokens = DEFAULT_LIMITS.get(device, DEFAULT_LIMITS["cpu"])
    if cfg.max_num_seqs < 0 or cfg.max_num_batched_tokens < 0:
        raise KilnError(f"max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens="
                        f"{cfg.max_num_batched_tokens}: use positive numbers (0: the device's "
                        f"defaults, {seqs} and {tokens} here)")
    return cfg.max_num_seqs or seqs, cfg.max_num_batched_tokens or tokens


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    request: Request | None = field(default=None, repr=False)


def _resolve_device(cfg: EngineConfig):
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KilnError("device cuda was asked for but torch sees no CUDA device")
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if cfg.dtype == "auto":
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
    elif cfg.dtype in names:
        dtype = names[cfg.dtype]
    else:
        raise KilnError(f"dtype {cfg.dtype!r}: use one of auto, {', '.join(names)}")
    return device, dtype


class LLMEngine:
    """A loaded model ready to generate. ``model`` is a path (see ``kiln.llm.loader``)."""

    def __init__(self, model, config: EngineConfig | None = None, _parts=None):
        from kiln.llm.loader import load_model

        self.config = cfg = config or EngineConfig()
        if _parts is None:
            device, dtype = _resolve_device(cfg)
            _parts = load_model(model, device, dtype, cfg.weights)
        self.model, self.tokenizer, self.model_name = _parts
        device = self.model.device.type
        self.max_num_seqs, self.max_num_batched_tokens = scheduler_limits(cfg, device)
        self.runner = _make_runner(self.model, cfg, self.max_num_seqs)
        mc = self.model.cfg
        max_len = cfg.max_model_len or min(mc.max_position, 4096 if device == "cpu" else 1 << 30)
        # an ONNX decoder keeps its own past tensors: a cached block is no past for it
        prefix = cfg.enable_prefix_caching and not getattr(self.runner, "own_kv", False)
        if cfg.warmup and device == "cuda" and hasattr(self.runner, "warmup"):
            self.runner.warmup(self.max_num_batched_tokens)
        self.kv = KVCacheManager(self.runner.num_blocks, cfg.block_size, prefix)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_len, long_prefill_token_threshold=cfg.long_prefill_token_threshold),
            self.kv)
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.scheduler.eos_token_ids = tuple(sorted(eos))
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.metrics = EngineMetrics()
        self.profile = None  # a StepProfile while a benchmark times the steps' parts
        self._ids = itertools.count()
        # what loading left behind lives as long as the engine: out of the collector's scans
        # (a full collection walked every object of torch, the tokenizer and the weights'
        # bookkeeping, ~5% of a CPU decode step; vLLM freezes after startup too)
        _freeze_gc()

    @classmethod
    def from_model(cls, model, tokenizer, name: str, config: EngineConfig | None = None):
        """An engine over an already built LlamaModel (benchmarks with random weights)."""
        return cls(None, config, _parts=(model, tokenizer, name))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Request:
        """Queue a prompt (text, or token ids). Raises KilnError if it can never fit."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = [i for i in ids if not 0 <= i < self.model.cfg.vocab_size]
        if bad:
            raise KilnError(f"prompt token id {bad[0]} is outside the vocabulary "
                            f"(0..{self.model.cfg.vocab_size - 1})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params)
        self.scheduler.add_request(req)
        self.detok[rid] = IncrementalDetokenizer(self.tokenizer, ids, params)
        self.metrics.on_arrival(req)
        return req

    def abort(self, request_id: str):
        self.scheduler.abort(request_id)
        self._drop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def set_profile(self, profile=None):
        """Time every step's parts into ``profile`` (a ``kiln.llm.profile.StepProfile``);
        None: stop."""
        self.profile = self.runner.profile = profile

    def step(self) -> list[StepOutput]:
        prof = self.profile
        if prof is not None:
            prof.begin()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        if prof is not None:
            prof.mark("schedule")
        sampled = self.runner.execute(sched)
        now = time.monotonic()
        events = self.scheduler.update_from_output(sched, sampled, now)
        if prof is not None:
            prof.mark("update")
        outs = [self._emit(req, tok) for req, tok in events if tok is not None]
        if prof is not None:
            prof.mark("emit")
        self.metrics.on_step(sched, self.scheduler, self.kv, len(sampled))
        if prof is not None:
            prof.mark("metrics")
            prof.end(tokens=sched.num_batched_tokens, seqs=len(sched.scheduled),
                     sampled=len(sampled))
        return outs

    def _emit(self, req: Request, tok: int) -> StepOutput:
        d = self.detok[req.request_id]
        text = d.add(tok)
        if d.stopped_by is not None and not req.status.finished:
            self.scheduler.finish(req.request_id, Status.FINISHED_STOPPED, d.stopped_by)
        if req.status.finished:
            text += d.flush()
            self.metrics.on_finish(req)
            self._drop(req.request_id)
        return StepOutput(req.request_id, [tok], text, req.status.finished,
                          req.status.value if req.status.finished else None, req.stop_reason,
                          req)

    def _drop(self, request_id: str):
        self.detok.pop(request_id, None)
        self.runner.forget(request_id)


def _freeze_gc():
    gc.collect()
    gc.freeze()
    global _UNFREEZE_AT_EXIT
    if not _UNFREEZE_AT_EXIT:  # so that what is frozen is still collected at exit (nanobind
        # types, e.g. triton's, report "leaked" instances otherwise)
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT = True


_UNFREEZE_AT_EXIT = False


def _make_runner(model, cfg: EngineConfig, max_num_seqs: int | None = None):
    from kiln.llm import kv_quant
    from kiln.llm.onnx_decoder import OnnxDecoder, OnnxModelRunner
    from kiln.llm.runner import ModelRunner, blocks_from_memory

    kv_dtype = kv_quant.resolve(cfg.kv_cache_dtype, model.dtype)
    if isinstance(model, OnnxDecoder) and cfg.kv_cache_dtype != "auto":
        raise KilnError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} needs kiln's paged KV cache; an "
                        "ONNX decoder keeps its own past_key_values tensors: leave "
                        "kv_cache_dtype at 'auto' (--kv-cache-dtype auto) for .onnx models")
    n = cfg.num_blocks or blocks_from_memory(model, cfg.block_size, cfg.memory_fraction,
                                             kv_dtype)
    if isinstance(model, OnnxDecoder):
        return OnnxModelRunner(model, n, cfg.block_size)
    kv = dict(kv_cache_dtype=cfg.kv_cache_dtype, calculate_kv_scales=cfg.calculate_kv_scales)
    if model.device.type == "cuda":
        from kiln.llm.cuda_runner import CudaModelRunner

        max_num_seqs = max_num_seqs or scheduler_limits(cfg, "cuda")[0]
        return CudaModelRunner(model, n, cfg.block_size, cuda_graphs=cfg.cuda_graphs,
                               max_batch=max_num_seqs,
                               max_model_len=cfg.max_model_len or None, **kv)
    return ModelRunner(model, n, cfg.block_size, native_decode=cfg.native_decode, **kv)
