"""Prometheus series for delta updates, served on vLLM's own `/metrics`.

Why on the default registry: vLLM's `/metrics` exports it directly, or through the multiprocess
collector when several API servers run, in which case prometheus_client writes these values to
`PROMETHEUS_MULTIPROC_DIR` like vLLM's own. They are created once per process, on first use.
"""

from __future__ import annotations

from threading import Lock
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SIZES = tuple(float(4**k) for k in range(4, 19))  # 256 .. 2^36


class DeltaMetrics:
    """The series one successful or failed update moves."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(f"vllm_delta:{name}_seconds", doc, buckets=SECONDS, registry=registry)

        self.decode = seconds("decode", "Reading, verifying and decoding a delta (not paused; slowest rank).")
        self.apply = seconds("apply", "Scattering a delta into the live weights (slowest rank).")
        self.pause = seconds("pause", "Generation paused for one update.")
        self.bytes_read = Histogram(
            "vllm_delta:bytes_read",
            "Delta bytes read by one update (largest rank).",
            buckets=SIZES,
            registry=registry,
        )
        self.changed = Histogram(
            "vllm_delta:changed_elements",
            "Changed checkpoint elements per update.",
            buckets=SIZES,
            registry=registry,
        )
        self.version = Gauge(
            "vllm_delta:weights_version",
            "Weight version the engine serves.",
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.phases = Histogram(
            "vllm_delta:sync_phase_seconds",
            "Seconds one sync spent in each phase (slowest rank; engine/trace.py names them).",
            ["phase"],
            buckets=SECONDS,
            registry=registry,
        )
        self.failures = Counter(
            "vllm_delta:update_failures",
            "Refused or failed updates, by HTTP status.",
            ["status"],
            registry=registry,
        )

    def observe(self, result: dict[str, Any]) -> None:
        """Record a successful sync's answer (the route's 200, the backend's finish)."""
        self.decode.observe(result["decode_s"])
        self.apply.observe(result["apply_s"])
        self.pause.observe(result["pause_s"])
        self.bytes_read.observe(result["bytes_read"])
        self.changed.observe(result["changed"])
        self.version.set(result["version"])
        for phase, seconds in (result.get("trace") or {}).get("phases", {}).items():
            self.phases.labels(phase).observe(seconds)

    def failed(self, status: int) -> None:
        self.failures.labels(str(status)).inc()


_metrics: DeltaMetrics | None = None
_lock = Lock()


def delta_metrics() -> DeltaMetrics:
    """The process's metrics, registered on first call."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = DeltaMetrics()
        return _metrics
