"""Builder: ONNX model -> optimized graph -> kernel choice per layer -> Engine."""

from __future__ import annotations

import time
from typing import Callable

import torch

from kiln.builder import autotune
from kiln.builder.calibration import apply_int8, first_nonfinite
from kiln.builder.config import BuilderConfig
from kiln.builder.precision import lower_precision
from kiln.engine.engine import Engine, TensorInfo
from kiln.engine.profile import Profile, tuning_points, validate_profile
from kiln.errors import KilnError
from kiln.frontend import fixed_dims, import_onnx
from kiln.ir import Graph
from kiln.kernels.registry import kernels_for
from kiln.passes.fusion.match import NOT_FUSED
from kiln.passes.pipeline import optimize
from kiln.passes.quantize.data import load_batches
from kiln.passes.quantize.dynamic import (
    fold_dynamic_quant,
    fuse_conv_integer_bias,
    fuse_dynamic_conv,
    fuse_dynamic_matmul_integer,
)
from kiln.passes.quantize.handoff import fuse_handoffs
from kiln.passes.quantize.int8 import weight_grids
from kiln.passes.quantize.qdq import (
    fold_qdq,
    fuse_qdq_pairs,
    fuse_qlinear_matmul,
    fuse_requantize,
    lower_qlinear,
)
from kiln.passes.verifier import verify


class Builder:
    """Builds engines: ``Builder(BuilderConfig(...)).build("model.onnx")``.

    ``log`` receives one line per step (what the CLI prints with ``--verbose``), including one
    ``not fused: <pattern> at node '<name>': <why>`` line per candidate a fusion rejected;
    ``report["near_misses"]`` lists those (without the prefix) after a build.

    On ``device="cuda"`` with a GPU present (and Triton importable), every layer that has CUDA
    kernels is autotuned at each optimization profile's opt shapes: its candidates (kernel x
    tactic, and the PyTorch kernel) are timed with ``timer`` (default:
    :func:`autotune.cuda_timer`) through the timing cache ``config.timing_cache``; the plan
    records the fastest kernel and its tactic per profile (inputs run the kernels of the profile
    they match), ``report["autotune"]`` every :class:`autotune.Selection` of the first profile
    (with the runner-up), ``report["autotune_profiles"]`` those of every profile.
    """

    def __init__(self, config: BuilderConfig | None = None, log: Callable[[str], None] = None,
                 timer: Callable | None = None):
        self.config = config or BuilderConfig()
        self.log = log or (lambda msg: None)
        self.timer = timer
        self.report: dict = {}

    def build(self, model, base_dir=None) -> Engine:
        """Build from a path, the bytes of a model, or a ``ModelProto``.

        Raises :class:`kiln.errors.KilnError` subclasses for unreadable models, unsupported
        ops (all listed at once) and profiles that do not fit the model's inputs."""
        cfg, t0 = self.config, time.perf_counter()
        # a profile's fixed dims specialize the graph: its shape arithmetic on them folds away
        graph = import_onnx(model, base_dir, fixed=fixed_dims(cfg.profiles))
        t_parse = time.perf_counter()
        self.log(f"parsed {len(graph.nodes)} nodes, {len(graph.weights)} weights "
                 f"in {1e3 * (t_parse - t0):.0f} ms")
        inputs = [TensorInfo.of(v) for v in graph.inputs]
        for p in cfg.profiles:
            validate_profile(p, inputs)
        if not cfg.profiles:
            self._log_dynamic_inputs(inputs)
        before, near = graph.op_counts(), []
        self.report = {}
        # QOperator layers in QDQ form, which folds below (convolutions: see qlinear_conv_int8)
        lower_qlinear(graph, self.log, conv=cfg.qlinear_conv_int8 or cfg.device == "cuda")
        grid = weight_grids(graph)  # a quantized model's weight scales, before they fold
        explicit = {**fold_qdq(graph, self.log, shared=cfg.qdq_shared_int8),
                    **fold_dynamic_quant(graph, self.log)}
        fuse_qdq_pairs(graph, self.log)  # the pairs left, each one pass
        if cfg.device == "cpu":  # (CUDA: no integer batched matmul kernel)
            fuse_qlinear_matmul(graph, self.log)
        fuse_conv_integer_bias(graph, self.log)
        if cfg.device == "cpu":
            fuse_dynamic_conv(graph, self.log)
            fuse_dynamic_matmul_integer(graph, self.log)
        if cfg.optimize:
            graph = optimize(graph, log=_near_misses(self.log, near), device=cfg.device)
        keep_fp32 = [k for k, p in cfg.layer_precision.items() if p == "fp32"]
        if cfg.int8 or cfg.fp8 or explicit:
            self.report["int8"] = apply_int8(graph, cfg, explicit, self.log,
                                             grid if explicit else None)
            if explicit and cfg.device == "cpu":  # CUDA keeps its Triton INT8 GEMMs
                fuse_requantize(graph, self.log)
        if cfg.fp16 or cfg.bf16:  # FP16 when both are allowed: more mantissa, same speed
            lower_precision(graph, "fp16" if cfg.fp16 else "bf16", log=self.log,
                            io=cfg.low_precision_io, keep_fp32=keep_fp32)
        if "int8" in self.report and cfg.device == "cuda" and cfg.int8_handoff:
            self.report["int8"]["handoffs"] = fuse_handoffs(graph, self.log)
            verify(graph, after="fuse_handoffs")
        tuned = self._autotune(graph)  # picks per profile, or None
        choices, tactics = self._choose_kernels(graph, tuned[0] if tuned else None)
        variants = [self._choose_kernels(graph, p) for p in (tuned or [])[1:]]
        t_end = time.perf_counter()
        self.report.update({"nodes_before": before, "nodes_after": graph.op_counts(),
                            "near_misses": near,
                            "parse_s": t_parse - t0, "total_s": t_end - t0})
        if cfg.device == "cuda":
            self._log_host_fallbacks(graph)
        self.log(f"built {len(graph.nodes)} layers in {t_end - t0:.2f} s")
        build = dict(cfg.to_json(), build_seconds=round(t_end - t0, 3))
        engine = Engine(graph, choices, device=cfg.device, profiles=cfg.profiles, build=build,
                        tactics=tactics, variants=variants,
                        buckets=getattr(self, "_buckets", None) if tuned else None)
        if "autotune" in self.report and getattr(self, "_tuning_complete", True):
            self._record_binaries(engine)  # a CUDA build with the Triton kernels, whose tuning
            # run took random inputs (the recording run takes the same: they would fail there)
        # the tuning run feeds integer inputs zeros (a valid index, token id, mask, trip
        # count); a graph with a Loop keeps its tactics to its first run all the same (its
        # termination may hang on input values: a random trip count ran for ever)
        if cfg.device == "cpu" and all(i.dtype is not None for i in engine.inputs) and (
                all(i.dtype.is_float for i in engine.inputs) or not _has_loop(graph)):
            self._tune_cpu(engine)
            engine.build_info["build_seconds"] = round(time.perf_counter() - t0, 3)
            self.report["total_s"] = time.perf_counter() - t0
        if cfg.check_finite and (cfg.fp16 or cfg.bf16 or "int8" in self.report):
            self._check_finite(engine)
        return engine

    def _check_finite(self, engine: Engine) -> None:
        """Run the engine once on the first calibration batch (or random inputs) and report
        the first layer whose output holds NaN or Inf (``report["nonfinite"]``)."""
        from kiln.engine.inputs import tuning_inputs

        cfg = self.config
        try:
            if cfg.calib is not None:
                feeds = load_batches(cfg.calib, [i.name for i in engine.inputs])[0]
            else:  # zero integers: a random token id past a table's end is a device-side
                # assert on CUDA, which no process survives (a BERT's 2-row token types)
                feeds = tuning_inputs(engine.inputs, (cfg.profiles or [None])[0], seed=0)
            bad = first_nonfinite(engine.executor_for(0), feeds)
        except Exception as e:  # data the check cannot run on: say so, the build stands
            self.log(f"NaN/Inf check: not run ({type(e).__name__}: {str(e)[:200]})")
            return
        self.report["nonfinite"] = bad
        if bad is not None:
            self.log(f"WARNING: layer '{bad[0]}' outputs NaN or Inf (tensor {bad[1]}) on the "
                     "check data; pin it with --layer-precision NAME:fp32")
        else:
            self.log("NaN/Inf check: every layer's output is finite on the check data")

    def _log_dynamic_inputs(self, inputs: list[TensorInfo]) -> None:
        """Say which inputs have dims no profile fixes, what the build assumes for them, and
        how to build for the shapes that will run (an unprofiled dim is tuned at 1)."""
        dynamic = [i for i in inputs
                   if i.shape is None or any(not isinstance(d, int) for d in i.shape)]
        if not dynamic:
            return
        self.report["dynamic_inputs"] = [i.name for i in dynamic]
        named = ", ".join(f"'{i.name}' {i.shape_str()}" for i in dynamic[:4])
        example = ",".join(f"{i.name}:" + "x".join(
            str(d) if isinstance(d, int) else f"<{d or '?'}>" for d in (i.shape or ("*",)))
            for i in dynamic)
        self.log(f"note: dynamic inputs without a profile: {named}"
                 f"{' ...' if len(dynamic) > 4 else ''}: the build tunes and packs at 1 for each "
                 "unknown dim, and the first run at any other shape times its tactics then; for "
                 f"the shapes you will run, pass --shapes {example} (or --min/--opt/--max-shapes "
                 "for a range), which also folds the shape arithmetic those dims fix")

    def _tune_cpu(self, engine: Engine) -> None:
        """Run the engine once at each profile's opt shapes (or the default shapes), so that
        its CPU GEMM and conv tactics are timed now (their picks stored in the engine file:
        a loaded engine's first run times nothing) and its weights are packed; picks already
        in the timing cache are not timed again."""
        import json

        from kiln.kernels.torch import fused_conv as FCK

        t0 = time.perf_counter()
        cache = autotune.TimingCache(self.config.timing_cache, autotune.cpu_device_key(),
                                     log=self.log)
        cached = {}
        for k, v in cache.picks().items():
            try:
                cached.update(FCK.picks_from_json([[json.loads(k), v]]))
            except ValueError:
                continue
        FCK.preload_picks(cached)
        ctx = engine.create_context()
        with FCK.record_picks() as picks:
            self._run_each_profile(ctx, engine, "CPU tactics: the tuning run",
                                   "the layers it did not reach are timed at their first run")
        engine.cpu_tactics = dict(picks)
        rows = FCK.picks_to_json(picks)
        cache.put_picks({json.dumps(s): v for s, v in rows})
        cache.save()
        hit = sum(s in cached for s in picks)
        self.log(f"CPU tactics: {len(picks)} picks ({hit} from the timing cache) in "
                 f"{time.perf_counter() - t0:.2f} s")
        self.report["cpu_tactics"] = {"picks": len(picks), "cached": hit,
                                      "seconds": time.perf_counter() - t0}

    def _run_each_profile(self, ctx, engine: Engine, what: str, unreached: str) -> None:
        """Run ``ctx`` once per tuning point of each profile, on seeded random floats and zero
        integers and booleans (random ones would be out-of-range indices, huge trip counts);
        data a model cannot take is logged, not fatal."""
        from kiln.engine.inputs import tuning_inputs

        for k, p in engine.tuning_runs():
            ctx.profile = k if p is not None else None
            try:
                ctx.run(tuning_inputs(engine.inputs, p))
            except Exception as e:
                self.log(f"{what} at profile {k}{f' at {dict(p.opt)}' if p else ''} failed "
                         "on random inputs "
                         f"({type(e).__name__}: {str(e)[:200]}); {unreached}")

    def _log_host_fallbacks(self, graph: Graph) -> None:
        """Name every layer a CUDA engine runs on the host (none should run there silently)."""
        from kiln.engine.placement import host_fallbacks

        found = host_fallbacks(graph)
        self.report["host_fallbacks"] = found
        for name, why in found.items():
            self.log(f"host fallback: node '{name}' ({why})")

    def _record_binaries(self, engine: Engine) -> None:
        """Run the engine once at each profile's opt shapes (or the default shapes), recording
        the compiled Triton kernels it launches: they are saved in the engine file, so loading
        it compiles nothing (see :mod:`kiln.kernels.triton.binary`)."""
        from kiln.kernels.triton import binary

        if binary.triton_abi() is None:
            self.log("Triton binaries: not embedded (kiln does not know this Triton's launch "
                     "convention); kernels compile when the engine first runs them")
            return
        kernels = set(engine.choices.values()).union(*(c.values() for c, _ in engine.variants))
        if not any(k.startswith("Triton") for k in kernels):
            return  # nothing to record: every layer runs a PyTorch kernel
        t0 = time.perf_counter()
        ctx = engine.create_context(cuda_graph=False)
        with binary.Recorder() as rec:
            self._run_each_profile(ctx, engine, "Triton binaries: the recording run",
                                   "the kernels it did not reach compile on first use")
        engine.binaries = rec.entries
        self.report["binaries"] = {"embedded": len(rec.entries), "skipped": dict(rec.skipped),
                                   "seconds": round(time.perf_counter() - t0, 3)}
        kib = sum(len(b.cubin) for b in rec.entries.values()) / 1024
        self.log(f"Triton binaries: {len(rec.entries)} kernels embedded ({kib:.0f} KiB)"
                 + (f", {len(rec.skipped)} not embeddable: {sorted(set(rec.skipped.values()))}"
                    if rec.skipped else "") + f" in {time.perf_counter() - t0:.2f} s")

    def _tuning_runs(self) -> list[tuple[int, Profile | None]]:
        """``(profile index, profile at a tuning point)`` per tuning run: each profile's opt
        shapes, or its min, opt and max (``BuilderConfig.tune_at``). Sets ``self._buckets``,
        the engine's map from a run's shapes to the kernels tuned there."""
        cfg = self.config
        runs: list[tuple[int, Profile | None]] = []
        buckets = []
        for k, p in enumerate(cfg.profiles or [None]):
            if p is None:
                runs.append((k, None))
                continue
            b = []
            for pt in tuning_points(p, cfg.tune_at):
                b.append((pt, len(runs)))
                runs.append((k, p.at(pt)))
            buckets.append(b)
        self._buckets = buckets if any(len(b) > 1 for b in buckets) else None
        return runs

    def _precompile(self, graph: Graph, cache: autotune.TimingCache,
                    profiles: list[Profile]) -> None:
        """Compile the Triton candidates in worker processes first
        (:mod:`kiln.builder.precompile`), unless the timing cache already holds times for
        this device (a warm build: it times little and compiles mostly its winners)."""
        from kiln.builder import precompile as P

        cfg = self.config
        workers = P.default_workers() if cfg.compile_workers is None else cfg.compile_workers
        if workers < 2 or cache.entries.get(cache.device):
            return
        if len(P.tuned_layers(graph)) < P.MIN_LAYERS:  # starting the workers costs seconds
            return
        weight_bytes = sum(int(getattr(v.const, "nbytes", 0)) for v in graph.weights.values())
        workers = P.affordable(workers, weight_bytes)
        if workers < 2:
            return
        choices = {n.name: (kernels_for(n.op, "cpu") or kernels_for(n.op, "cuda"))[0].name
                   for n in _all_nodes(graph)}
        try:
            self.report["precompile"] = P.precompile(graph, choices, profiles, workers,
                                                     self.log)
        except Exception as e:  # the build compiles the candidates itself, as without it
            self.log(f"autotune: parallel compile not run ({type(e).__name__}: "
                     f"{str(e)[:200]}); compiling in the build process")

    def _choose_kernels(self, graph: Graph, picks: dict | None
                        ) -> tuple[dict[str, str], dict[str, dict]]:
        """``(choices, tactics)``: the kernel name per node, and the tactic per node whose
        kernel has one, from one profile's autotune ``picks``. Without tuning (CPU builds, no
        GPU, no Triton; ``picks`` None): the first kernel."""
        backend = self.config.device
        choices: dict[str, str] = {}
        tactics: dict[str, dict] = {}
        for n in _all_nodes(graph):
            sel = picks.get(n.name) if picks is not None else None
            if sel is not None:
                choices[n.name] = sel.kernel
                if sel.tactic is not None:
                    tactics[n.name] = dict(sel.tactic)
                continue
            ks = kernels_for(n.op, backend) or kernels_for(n.op, "cpu")
            if (picks is not None or not self.config.tune) and kernels_for(n.op, "cpu"):
                # tuned, and no CUDA kernel could run this node at the opt shapes (or it never
                # ran), or not tuned at all: the PyTorch kernel, which is what the tuner
                # itself runs
                ks = kernels_for(n.op, "cpu")
            if not ks:
                raise KilnError(f"node '{n.name}': op {n.op.qualname} has no {backend} kernel")
            choices[n.name] = ks[0].name
        return choices, tactics

    def _autotune(self, graph: Graph) -> list[dict[str, autotune.Selection]] | None:
        """Selections per tuned node for each optimization profile (at its opt shapes; one
        entry when there are no profiles), or None when this build does not tune."""
        cfg = self.config
        if cfg.device != "cuda" or not torch.cuda.is_available():
            return None
        if not cfg.tune:
            self.log("autotune: off (tune=False / --no-tune): every layer runs its first "
                     "kernel, untimed")
            return None
        try:
            import kiln.kernels.triton  # noqa: F401  (registers the CUDA kernels)
        except ImportError as e:
            self.log(f"autotune: Triton kernels unavailable ({e}); using the PyTorch kernels")
            return None
        t0 = time.perf_counter()
        cache = autotune.TimingCache(cfg.timing_cache, autotune.device_key(), log=self.log)
        runs = self._tuning_runs()
        self._precompile(graph, cache, [p for _, p in runs if p is not None])
        per_profile = []
        for k, profile in runs:
            if len(runs) > 1:
                self.log(f"autotune: profile {k} at {dict(profile.opt)}")
            status: dict = {}
            per_profile.append(autotune.tune_graph(graph, profile, cache, timer=self.timer,
                                                   log=self.log, plan_margin=cfg.plan_margin,
                                                   plan_payback=cfg.plan_payback,
                                                   status=status))
            self._tuning_complete = status.get("complete", False)
        timed = sum(s.timed for p in per_profile for s in p.values())
        cached = sum(s.cached for p in per_profile for s in p.values())
        # per-layer cuDNN margin picks, before the engine-wide rule marks its own switches
        kept = sum(s.plan_free for p in per_profile for s in p.values())
        for k, picks in enumerate(per_profile):
            total = sum(s.ms for s in picks.values())
            at = f" at shape point {k}" if len(per_profile) > 1 else ""
            loaded = autotune.untuned_libraries(graph, picks)
            for lib, n, saved, switched in autotune.drop_plans(picks, cfg.plan_margin, loaded,
                                                                  cfg.plan_payback):
                share = f"{saved:.3f} of {total:.3f} ms per run ({saved / max(total, 1e-9):.0%})"
                if switched:
                    self.log(f"autotune: {n} layers{at} would use {lib} to save {share}, not "
                             f"more than --plan-margin {cfg.plan_margin:g}: they take kernels "
                             f"that need no library, so a fresh process's first run never "
                             f"loads {lib}")
                else:
                    start = autotune.LIBRARY_START_MS.get(lib, autotune.PLAN_MS)
                    why = (", and untuned layers use it too" if lib in loaded
                           else f", more than --plan-margin {cfg.plan_margin:g}"
                           if saved > cfg.plan_margin * total
                           else f", which pays back its ~{start:.0f} ms start-up within "
                                f"--plan-payback {cfg.plan_payback} runs"
                           if cfg.plan_payback > 0 and saved * cfg.plan_payback > start
                           else ", and some have no library-free kernel")
                    self.log(f"autotune: {n} layers{at} use {lib}; a fresh process's first "
                             f"run pays its initialisation (they save {share}{why})")
        if kept:
            self.log(f"autotune: {kept} layers keep a kernel within {cfg.plan_margin:.0%} of a "
                     "faster cuDNN one, so the engine's first run makes no cuDNN plan for them "
                     "(--plan-margin 0 keeps the fastest everywhere)")
        self.log(f"autotune: {len(per_profile[0])} layers tuned"
                 f"{f' x {len(per_profile)} shape points' if len(per_profile) > 1 else ''}, "
                 f"{timed} candidates timed, {cached} from the timing cache, in "
                 f"{time.perf_counter() - t0:.2f} s")
        self.report["autotune"] = {name: s.to_json() for name, s in per_profile[0].items()}
        self.report["autotune_summary"] = {"timed": timed, "cached": cached,
                                           "seconds": round(time.perf_counter() - t0, 3)}
        if len(per_profile) > 1:
            self.report["autotune_profiles"] = [
                {name: s.to_json() for name, s in p.items()} for p in per_profile]
        return per_profile


def _near_misses(log: Callable[[str], None], into: list[str]) -> Callable[[str], None]:
    """``log``, also keeping each fusion's near miss ("attention at node 'x': why") in
    ``into``: the subgraphs a fusion almost matched."""
    def both(msg: str) -> None:
        if msg.startswith(NOT_FUSED):
            into.append(msg[len(NOT_FUSED):])
        log(msg)
    return both


def _all_nodes(graph: Graph):
    for n in graph.nodes:
        yield n
        for g in n.subgraphs():
            yield from _all_nodes(g)


def _has_loop(graph: Graph) -> bool:
    """Does ``graph`` or any subgraph hold a Loop node?"""
    from kiln.ops import control

    return any(n.op is control.Loop or any(_has_loop(g) for g in n.subgraphs())
               for n in graph.nodes)

