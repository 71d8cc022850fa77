"""One runner per system. Each turns a workload into a ready-to-time ``run()`` that performs one
finished forward pass (synchronized on CUDA), plus ``fetch()`` to read its outputs as numpy.

Systems: kiln (built, saved, and the *loaded* engine timed), onnxruntime, PyTorch eager (the zoo
module, FP32, ``torch.inference_mode``), torch.compile; on CUDA also PyTorch FP16 eager and
torch.compile(mode="reduce-overhead") in FP16 (CUDA graphs).

A peer with a ``build`` step (kiln) does its offline work there: the engine is built and saved
before ``prepare`` loads it, so that the inference numbers (memory, set-up) cover loading and
running only, as they do for the torch peers, whose FP16 weights are made on the host before
they move to the device.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.workloads import Workload


class Unavailable(Exception):
    """The system does not apply here (reported as "n/a: <reason>")."""


class Skipped(Exception):
    """The system was skipped (reported as "skipped: <reason>")."""


@dataclass
class Prepared:
    run: Callable[[], object]
    fetch: Callable[[object], list[np.ndarray]]
    first_call_s: float | None = None  # torch.compile: the first call, which compiles
    note: str = ""


@dataclass
class Peer:
    name: str
    precision: str  # "fp32" or "fp16"
    prepare: Callable[[Workload, str, Path], Prepared]
    is_kiln: bool = False
    # the offline step before ``prepare`` (kiln: build + save the engine file); returns a note
    build: Callable[[Workload, str, Path], str] | None = None

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.precision]


# Max relative error against the FP32 reference: max|out - ref| / max|ref| over each output.
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _as_numpy(values) -> list[np.ndarray]:
    return [np.asarray(v.detach().float().cpu() if hasattr(v, "detach") else v, dtype=np.float32)
            for v in values]


# ---- kiln -----------------------------------------------------------------------------------

def has_cuda_backend() -> bool:
    """kiln runs on CUDA wherever torch sees a GPU: its torch kernels (cuBLAS/cuDNN) always, and
    the Triton kernels where the builder's autotuner finds them faster."""
    import torch

    return torch.cuda.is_available()


def kiln_config(wl: Workload, device: str, fp16: bool):
    """The bench's build: on CUDA a fixed profile at the workload's shapes, so that the kernels
    are tuned where they run, as torch.compile specializes to them."""
    import kiln

    profiles = []
    if device == "cuda":
        profiles = [kiln.Profile.fixed({k: v.shape for k, v in wl.feeds.items()})]
    # FP16 on CUDA takes and gives FP16 tensors, as the torch FP16 peers do
    return kiln.BuilderConfig(device=device, fp16=fp16, profiles=profiles,
                              low_precision_io=fp16 and device == "cuda")


def engine_path(wl: Workload, tmp: Path, fp16: bool) -> Path:
    return tmp / f"{wl.key}{'-fp16' if fp16 else ''}.kiln"


def _kiln_build(fp16: bool):
    def build(wl: Workload, device: str, tmp: Path) -> str:
        import kiln

        if device == "cuda" and not has_cuda_backend():
            raise Unavailable("CUDA is not available on this machine")
        builder = kiln.Builder(kiln_config(wl, device, fp16))
        builder.build(str(wl.onnx_path())).save(engine_path(wl, tmp, fp16))
        nodes = builder.report.get("nodes_after", {})
        return f"{sum(nodes.values())} layers" if nodes else ""
    return build


def _kiln(fp16: bool):
    def prepare(wl: Workload, device: str, tmp: Path) -> Prepared:
        import kiln

        path = engine_path(wl, tmp, fp16)
        engine = kiln.load(path)
        path.unlink()  # the weights stay mapped; the file is not needed any more
        ctx = engine.create_context()
        feeds = {i.name: wl.feeds[i.name].astype(i.dtype.np, copy=False) for i in engine.inputs}
        names = [o.name for o in engine.outputs]
        if device == "cuda":
            # device tensors in and out, as the torch peers get them; the outputs are the CUDA
            # graph's own buffers until the next run, as torch.compile's CUDA graphs give theirs
            feeds = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
            return Prepared(lambda: ctx.run(feeds, copy_outputs=False),
                            lambda out: _as_numpy(out[n] for n in names))
        return Prepared(lambda: ctx.run(feeds), lambda out: _as_numpy(out[n] for n in names))
    return prepare


# ---- onnxruntime ----------------------------------------------------------------------------

def _onnxruntime(wl: Workload, device: str, tmp: Path) -> Prepared:
    import onnxruntime as ort

    so = ort.SessionOptions()  # default graph optimizations (ORT_ENABLE_ALL)
    so.intra_op_num_threads = os.cpu_count() or 1
    if device == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise Unavailable("CUDAExecutionProvider is not available in this onnxruntime")
        sess = ort.InferenceSession(str(wl.onnx_path()), so, providers=["CUDAExecutionProvider"])
        return _ort_cuda(sess, wl.feeds)
    sess = ort.InferenceSession(str(wl.onnx_path()), so, providers=["CPUExecutionProvider"])
    feeds = wl.feeds
    return Prepared(lambda: sess.run(None, feeds), _as_numpy)


def _ort_cuda(sess, feeds: dict) -> Prepared:
    """Inputs and outputs stay on the GPU (I/O binding), as they do for the torch peers."""
    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    binding = sess.io_binding()
    for k, t in dev.items():
        binding.bind_input(k, "cuda", 0, feeds[k].dtype.type, tuple(t.shape), t.data_ptr())
    for o in sess.get_outputs():
        binding.bind_output(o.name, "cuda")

    def run():
        sess.run_with_iobinding(binding)
        return binding

    return Prepared(run, lambda b: _as_numpy(b.copy_outputs_to_cpu()),
                    note="I/O binding on the GPU")


# ---- PyTorch --------------------------------------------------------------------------------

def build_module(wl: Workload) -> torch.nn.Module:
    """The zoo torch module with the weights of the ONNX export (same seed, same RNG path)."""
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        model, _ = wl.zoo_module.build(**wl.options)
    return model.eval()


def _torch_args(wl: Workload, device: str, fp16: bool) -> list[torch.Tensor]:
    args = [torch.from_numpy(wl.feeds[n]).to(device) for n in wl.zoo_module.INPUT_NAMES]
    return [a.half() if fp16 and a.is_floating_point() else a for a in args]


def _torch_run(fn, args, device: str, fp16: bool, step: Callable | None = None):
    def run():
        if step is not None:
            step()
        autocast = (torch.autocast("cuda", dtype=torch.float16) if fp16
                    else contextlib.nullcontext())
        with torch.inference_mode(), autocast:
            y = fn(*args)
        _sync(device)
        return y
    return run


def _fetch_torch(y) -> list[np.ndarray]:
    ys = y if isinstance(y, (tuple, list)) else (y,)
    return [t.detach().float().cpu().numpy() for t in ys]


def torch_module(wl: Workload, device: str, fp16: bool) -> torch.nn.Module:
    """The zoo module on ``device``; FP16 weights are made on the host first, so that the device
    only ever holds the weights the model runs with (an FP32 upload would double the peak)."""
    model = build_module(wl)
    if fp16:
        # Half weights; autocast casts the FP32 attention-mask arithmetic to FP16 too.
        model = model.half()
    return model.to(device)


def _eager(fp16: bool):
    def prepare(wl: Workload, device: str, tmp: Path) -> Prepared:
        model = torch_module(wl, device, fp16)
        args = _torch_args(wl, device, fp16)
        return Prepared(_torch_run(model, args, device, fp16), _fetch_torch)
    return prepare


@contextlib.contextmanager
def deadline(seconds: float | None, error: type[Exception] = TimeoutError, what: str = ""):
    """Raise ``error("<what>took longer than N s")`` in the main thread if the block runs
    longer than ``seconds`` (no limit without seconds, or off the main thread, which SIGALRM
    cannot interrupt)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise error(f"{what}took longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _compiled(fp16: bool, mode: str | None, compile_timeout: float | None):
    def prepare(wl: Workload, device: str, tmp: Path) -> Prepared:
        torch._dynamo.reset()  # no graphs or guards left over from the previous workload
        model = torch_module(wl, device, fp16)
        compiled = torch.compile(model, mode=mode)
        step = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else None
        run = _torch_run(compiled, _torch_args(wl, device, fp16), device, fp16, step)
        t0 = time.perf_counter()
        with deadline(compile_timeout, Skipped, "compile "):
            run()
        return Prepared(run, _fetch_torch, first_call_s=time.perf_counter() - t0)
    return prepare


# ---- the line-up ----------------------------------------------------------------------------

def peers(device: str, compile: bool = True, compile_timeout: float | None = 300.0) -> list[Peer]:
    """The systems for ``device``, reference candidates first (onnxruntime, then eager FP32)."""
    out = [Peer("onnxruntime", "fp32", _onnxruntime),
           Peer("torch eager", "fp32", _eager(False)),
           Peer("kiln", "fp32", _kiln(False), is_kiln=True, build=_kiln_build(False))]
    if compile:
        out.append(Peer("torch.compile", "fp32", _compiled(False, None, compile_timeout)))
    if device == "cuda":
        out += [Peer("kiln fp16", "fp16", _kiln(True), is_kiln=True, build=_kiln_build(True)),
                Peer("torch eager fp16", "fp16", _eager(True))]
        if compile:
            out += [Peer("torch.compile fp16", "fp16", _compiled(True, None, compile_timeout)),
                    Peer("torch.compile reduce-overhead fp16", "fp16",
                         _compiled(True, "reduce-overhead", compile_timeout))]
    return out


def max_rel_err(outs: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """max|out - ref| / max|ref|, the worst over all outputs (inf on a shape mismatch)."""
    if len(outs) != len(ref):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, ref):
        if o.shape != r.shape:
            return float("inf")
        scale = float(np.max(np.abs(r))) or 1.0
        err = float(np.max(np.abs(o.astype(np.float64) - r))) / scale if r.size else 0.0
        worst = max(worst, err if np.isfinite(err) else float("inf"))
    return worst
