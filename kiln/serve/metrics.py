"""Prometheus metrics under Triton's names, so existing dashboards and alerts read kiln.

Triton's counters are exposed without the ``_total`` suffix that prometheus-client adds to
every counter, so the ``nv_*`` families are rendered here; everything else (the batch-size
histogram, and whatever other parts of kiln register, e.g. the OpenAI routes) lives in
:attr:`Metrics.registry`, a prometheus-client registry rendered after them on ``/metrics``.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, Histogram, generate_latest

COUNTERS = {  # name -> help; labels model, version (+ reason for failures)
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (a batch of n counts n)",
    "nv_inference_exec_count": "Number of model executions performed (a batch counts 1)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in "
                                              "microseconds",
}
PENDING = "nv_inference_pending_request_count"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    """The server's metrics. ``registry``: a prometheus-client registry to share (one is made
    when None); routes added to the server may register their own metrics in it."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.batch_size = Histogram(
            "kiln_inference_batch_size", "Rows per model execution (the dynamic batcher's "
            "batch sizes)", ["model", "version"], buckets=BATCH_BUCKETS,
            registry=self.registry)
        self._values: dict[str, dict[tuple, float]] = {n: defaultdict(float) for n in COUNTERS}
        self._lock = threading.Lock()
        self.pending_source = lambda: {}  # () -> {(model, version): pending requests}

    def observe_execution(self, model: str, version: str, rows: int, timings, ok: bool) -> None:
        """One model execution of ``rows`` rows for ``len(timings)`` requests."""
        key = (model, version)
        with self._lock:
            v = self._values
            v["nv_inference_exec_count"][key] += 1
            v["nv_inference_count"][key] += rows
            v["nv_inference_queue_duration_us"][key] += sum(t.queue for t in timings) * 1e6
            v["nv_inference_compute_infer_duration_us"][key] += sum(
                t.compute for t in timings) * 1e6
        self.batch_size.labels(model, version).observe(rows)

    def request_done(self, model: str, version: str, seconds: float, error=None) -> None:
        """A request answered: success, or a failure with Triton's reason label."""
        with self._lock:
            v = self._values
            if error is None:
                v["nv_inference_request_success"][(model, version)] += 1
            else:
                v["nv_inference_request_failure"][(model, version, error.kind.reason)] += 1
            v["nv_inference_request_duration_us"][(model, version)] += seconds * 1e6

    def value(self, name: str, *labels) -> float:
        with self._lock:
            return self._values[name].get(tuple(labels), 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything."""
        lines = []
        with self._lock:
            snapshot = {n: dict(d) for n, d in self._values.items()}
        for name, help_ in COUNTERS.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
            names = ("model", "version", "reason") if name.endswith("failure") else (
                "model", "version")
            for labels, val in sorted(snapshot[name].items()):
                lines.append(f"{name}{{{_labels(names, labels)}}} {_num(val)}")
        lines += [f"# HELP {PENDING} Instantaneous number of pending requests awaiting "
                  f"execution", f"# TYPE {PENDING} gauge"]
        for labels, val in sorted(self.pending_source().items()):
            lines.append(f"{PENDING}{{{_labels(('model', 'version'), labels)}}} {_num(val)}")
        return ("\n".join(lines) + "\n").encode() + generate_latest(self.registry)


def _labels(names, values) -> str:
    def esc(s):
        return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return ",".join(f'{n}="{esc(v)}"' for n, v in zip(names, values))


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
