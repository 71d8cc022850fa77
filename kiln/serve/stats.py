"""The statistics extension's per-version records (``/v2/models/{m}/stats``, gRPC
ModelStatistics): Triton's field names, durations as ``{"count", "ns"}``."""

from __future__ import annotations


def model_stats(models, name: str, version: str) -> list[dict]:
    out = []
    for mname, m in sorted(models.models.items()):
        if name and mname != name:
            continue
        for v, mv in sorted(m.versions.items()):
            if version and str(v) != version or mv.scheduler is None:
                continue
            s = mv.scheduler.stats
            out.append({
                "name": mname, "version": str(v), "last_inference": s.last_inference_ms,
                "inference_count": s.inferences, "execution_count": s.executions,
                "inference_stats": {
                    "success": {"count": s.success, "ns": s.success_ns},
                    "fail": {"count": s.fail, "ns": 0},
                    "queue": {"count": s.success + s.fail, "ns": s.queue_ns},
                    "compute_input": {"count": 0, "ns": 0},
                    "compute_infer": {"count": s.success + s.fail, "ns": s.compute_ns},
                    "compute_output": {"count": 0, "ns": 0},
                },
                "batch_stats": [{"batch_size": b, "compute_infer": {"count": c, "ns": ns}}
                                for b, (c, ns) in sorted(s.batches.items())],
            })
    return out
