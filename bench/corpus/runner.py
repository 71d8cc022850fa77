"""One corpus model on the CPU: onnxruntime (the FP32 reference) and kiln, side by side in one
process, 2 threads each. Every stage that can fail is caught and named in the row."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.corpus.manifest import Entry
from bench.corpus.measure import TOLERANCE, describe_error, errors, interleaved, shape_note


@dataclass
class Options:
    device: str = "cpu"
    threads: int = 2
    warmup_s: float = 0.3
    min_s: float = 1.0
    min_iters: int = 10
    kiln_only: bool = False  # CUDA: kiln FP16 at batch 1 alone (no peers, no large batch)
    large_batch: int = 0  # CUDA: the large batch for every batch-dynamic model (0: per family)


def ort_session(path: Path | bytes, device: str, threads: int, optimize: bool = True):
    """``optimize``: onnxruntime's default graph optimizations (ORT_ENABLE_ALL), or none;
    ``path`` a file or a serialized model."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), so,
                                providers=providers)


def kiln_outputs(out) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.detach().cpu().float() if hasattr(v, "detach") else v)
            for k, v in out.items()}


def kiln_feeds(engine, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {i.name: feeds[i.name].astype(i.dtype.np, copy=False) for i in engine.inputs}


def count_nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def near_misses(report: dict):
    """The builder's record of fusions that almost matched, as a count (None: this builder
    does not record them). The passes helper fills ``Builder.report["near_misses"]``: a list of
    ``{"fusion": ..., "node": ..., "reason": ...}``."""
    found = report.get("near_misses")
    if found is None:
        return None, []
    items = list(found.values()) if isinstance(found, dict) else list(found)
    return len(items), items[:20]


def base_row(entry: Entry) -> dict:
    return {"model": entry.name, "family": entry.family, "source": entry.source,
            "exporter": entry.exporter, "opset": entry.opset, "bytes": entry.bytes,
            "status": "ok", "error": "", "correct": None, "max_rel_err": None,
            "errors": {}, "nodes_in": None, "layers_out": None, "near_misses": None,
            "kiln_ms": None, "ort_ms": None, "ratio": None, "build_s": None,
            "kiln_first_run_ms": None, "first_run_ratio": None, "ort_first_run_ms": None}


def run_reference(path: Path, feeds: dict, opts: Options, row: dict):
    """onnxruntime: session + first run timed together; returns (session, outputs)."""
    t0 = time.perf_counter()
    sess = ort_session(path, opts.device, opts.threads)
    names = [o.name for o in sess.get_outputs()]
    ins = {i.name for i in sess.get_inputs()}
    outs = dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in ins})))
    row["ort_first_run_ms"] = 1e3 * (time.perf_counter() - t0)
    return sess, ins, outs


def build_kiln(path: Path, opts: Options, tmp: Path, row: dict, tune: bool = True,
               shapes: dict | None = None) -> Path:
    """The engine file for ``path``; ``shapes`` (input -> shape) fixes the profile, as
    trtexec's ``--shapes`` does: the builder then times tactics and packs weights at the
    shapes the model will run at, and folds the shape arithmetic those dims fix."""
    import kiln

    profiles = [kiln.Profile.fixed(shapes)] if shapes else None
    # strict FP32 (TF32 off): the check's 1e-4 bound is an FP32 one; TF32 convs miss it by 10x
    builder = kiln.Builder(kiln.BuilderConfig(device=opts.device, tf32=False, tune=tune,
                                              profiles=profiles))
    t0 = time.perf_counter()
    engine = builder.build(str(path))
    row["build_s"] = time.perf_counter() - t0
    row["layers_out"] = sum(builder.report.get("nodes_after", {}).values()) or None
    row["near_misses"], row["near_miss_detail"] = near_misses(builder.report)
    out = tmp / f"{path.stem}.kiln"
    engine.save(out)
    return out


def run_model(entry: Entry, corpus: Path, tmp: Path, opts: Options) -> dict:
    """The row for one model; never raises for the model's own failures."""
    import kiln  # before torch, as a kiln user's script would: kiln sets OpenMP's wait policy

    import torch  # isort: skip

    torch.set_num_threads(opts.threads)
    row = base_row(entry)
    from kiln import settings

    row["omp_wait_policy"] = (f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} "
                              f"({settings.omp_wait_policy_source})")
    path = corpus / entry.file
    feeds = entry.feeds(seed=0)
    try:
        row["nodes_in"] = count_nodes(path)
    except Exception as exc:
        return dict(row, status="unreadable", error=describe_error("onnx.load", exc))
    refs = sess = None
    try:
        sess, ort_inputs, refs = run_reference(path, feeds, opts, row)
    except Exception as exc:  # kiln still runs; nothing to check it against
        row.update(status="no reference", error=describe_error("onnxruntime", exc))
    try:
        engine_file = build_kiln(path, opts, tmp, row,
                                 shapes={k: tuple(v.shape) for k, v in feeds.items()})
    except Exception as exc:
        return dict(row, status="build failed", error=describe_error("kiln build", exc))
    try:
        t0 = time.perf_counter()
        ctx = kiln.load(engine_file).create_context()
        kfeeds = kiln_feeds(ctx.engine, feeds)
        outs = kiln_outputs(ctx.run(kfeeds))
        row["kiln_first_run_ms"] = 1e3 * (time.perf_counter() - t0)
    except Exception as exc:
        return dict(row, status="run failed", error=describe_error("kiln run", exc))
    if refs is not None:
        check(row, outs, refs, spread=lambda: reference_spread(path, feeds, refs))
    fns = {"kiln": lambda: ctx.run(kfeeds)}
    if sess is not None:
        ort_feeds = {k: v for k, v in feeds.items() if k in ort_inputs}
        fns["ort"] = lambda: sess.run(None, ort_feeds)
    try:
        t = interleaved(fns, opts.min_s, opts.min_iters, opts.warmup_s)
    except Exception as exc:
        return dict(row, status="run failed", error=describe_error("timing", exc))
    row["kiln_ms"] = t["kiln"]["median_ms"]
    if refs is not None and row.get("correct"):
        steady_check(row, kiln_outputs(ctx.run(kfeeds)), refs,
                     lambda: reference_spread(path, feeds, refs))
    row["iterations"] = {k: v["iterations"] for k, v in t.items()}
    row["first_run_ratio"] = row["kiln_first_run_ms"] / row["kiln_ms"]
    try:  # the same engine file loaded with warm_up=True: load + warm-up, then the first run
        t0 = time.perf_counter()
        warm = kiln.load(engine_file, warm_up=True)
        t1 = time.perf_counter()
        warm.create_context().run(kfeeds)
        row["kiln_warm_load_ms"] = 1e3 * (t1 - t0)
        row["kiln_warm_first_run_ms"] = 1e3 * (time.perf_counter() - t1)
    except Exception as exc:
        row["kiln_warm_load_ms"] = describe_error("kiln warm-up", exc)
    if "ort" in t:
        row["ort_ms"] = t["ort"]["median_ms"]
        row["ratio"] = row["kiln_ms"] / row["ort_ms"]
    return row


def reference_spread(path: Path, feeds: dict, refs: dict) -> dict[str, float]:
    """How far onnxruntime moves from its own reference, per output: the same model with
    every graph optimization off, on one thread, against ``refs`` (all optimizations, the
    bench's threads); and for a QDQ model, the model with its weights' DequantizeLinears
    folded into float32 initializers (:func:`fold_weight_dequantize`), which onnxruntime
    multiplies with its prepacked SGEMM instead of the unpacked one: where the model
    requantizes those products, the two sums' last-bit differences flip codes (on
    hf_distilbert_qstatic_qdq, 9e-3 of the output). The larger of the two per output. Where an
    output is ill-conditioned (a saturated sigmoid whose largest value is 6e-5) FP32 rounding
    alone exceeds 1e-4 of it, and onnxruntime disagrees with itself by as much as kiln does."""
    import onnx

    def run(model):
        sess = ort_session(model, "cpu", 1, optimize=isinstance(model, bytes))
        ins = {i.name for i in sess.get_inputs()}
        outs = dict(zip([o.name for o in sess.get_outputs()],
                        sess.run(None, {k: v for k, v in feeds.items() if k in ins})))
        return errors({k: v for k, v in outs.items() if k in refs}, refs)

    spread = run(path)
    folded, n = fold_weight_dequantize(onnx.load(str(path)))
    if n:
        for k, e in run(folded.SerializeToString()).items():
            spread[k] = max(spread.get(k, 0.0), e)
    return spread


def fold_weight_dequantize(model):
    """(a copy of ``model`` with each DequantizeLinear of initializers, per tensor or per
    axis, replaced by its float32 result as an initializer, the number replaced):
    ``float32(q - zero) * scale``, onnxruntime's steps."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    keep, done = [], 0
    for node in g.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or \
                not all(i in inits for i in node.input if i) or attrs.get("block_size"):
            keep.append(node)
            continue
        q = numpy_helper.to_array(inits[node.input[0]])
        s = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        z = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and \
            node.input[2] else np.zeros_like(s, dtype=np.int32)
        if q.dtype.kind not in "iu" or s.dtype != np.float32:
            keep.append(node)
            continue
        shape = [1] * q.ndim
        if s.size > 1:
            shape[attrs.get("axis", 1) % q.ndim] = s.size
        w = (q.astype(np.int32) - z.astype(np.int32).reshape(shape)).astype(np.float32) * \
            s.reshape(shape)
        g.initializer.append(numpy_helper.from_array(w.astype(np.float32), node.output[0]))
        done += 1
    del g.node[:]
    g.node.extend(keep)
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    live = [t for t in g.initializer if t.name in read]
    del g.initializer[:]
    g.initializer.extend(live)
    return out, done


def steady_check(row: dict, outs: dict, refs: dict, spread=None) -> None:
    """The outputs of a run after the timed ones (the native program planned from the first
    run, where the first ran step by step) checked as :func:`check` checks the first run's:
    ``steady_max_rel_err``; where they miss, the row is a mismatch too (a float GEMM record
    that sums in another order than the first run's kernel flipped a QDQ model's codes)."""
    later: dict = {}
    check(later, outs, refs, spread=spread)
    row["steady_max_rel_err"] = later.get("max_rel_err")
    if "ref_spread" in later:
        row["steady_ref_spread"] = later["ref_spread"]
    if not later.get("correct"):
        row.update(correct=False, status="mismatch",
                   error=f"a later (planned) run: {later.get('error')}")


def check(row: dict, outs: dict, refs: dict, spread=None) -> None:
    """Correct: every output within 1e-4 (max rel err) of onnxruntime's, or, where that fails
    and ``spread()`` is given, within onnxruntime's own spread on that output (see
    :func:`reference_spread`; recorded as ``ref_spread``)."""
    try:
        errs = errors(outs, refs)
    except KeyError as exc:
        row.update(status="mismatch", correct=False, error=describe_error("outputs", exc))
        return
    row["errors"] = errs
    row["max_rel_err"] = max(errs.values(), default=0.0)
    tol = dict.fromkeys(errs, TOLERANCE["fp32"])
    if spread is not None and any(e > tol[n] for n, e in errs.items()):
        try:
            row["ref_spread"] = sp = spread()
            tol = {n: max(t, sp.get(n, 0.0)) for n, t in tol.items()}
        except Exception as exc:  # the spread is a second opinion; without it, 1e-4 stands
            row["ref_spread"] = describe_error("onnxruntime spread", exc)
    row["correct"] = all(e <= tol[n] for n, e in errs.items())
    if not row["correct"]:
        worst = max(errs, key=lambda n: errs[n] / tol[n])
        note = shape_note(outs, refs)
        row.update(status="mismatch", error=note or f"output {worst!r}: max rel err "
                   f"{errs[worst]:.2e} > {tol[worst]:.0e}")
