"""Prometheus series for delta updates (on the registry vLLM's `/metrics` exports), and each door's one
record of a sync or a refusal."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable
from typing import Any

from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from vllm_delta.engine.http_errors import UpdateError

logger = logging.getLogger("vllm.delta_updates")

SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SIZES = tuple(float(4**k) for k in range(4, 19))  # 256 .. 2^36


class DeltaMetrics:
    """The series one successful or failed update moves."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...] = SECONDS, *labels: str) -> Histogram:
            return Histogram(f"vllm_delta:{name}", doc, labels, buckets=buckets, registry=registry)

        doc = "Reading, verifying and decoding a delta (not paused; slowest rank)."
        self.decode = histogram("decode_seconds", doc)
        self.apply = histogram("apply_seconds", "Scattering a delta into the live weights (slowest rank).")
        self.pause = histogram("pause_seconds", "Generation paused for one update.")
        self.bytes_read = histogram("bytes_read", "Delta bytes read by one update (largest rank).", SIZES)
        self.changed = histogram("changed_elements", "Changed checkpoint elements per update.", SIZES)
        doc = "Weight version the engine serves."
        self.version = Gauge(
            "vllm_delta:weights_version", doc, multiprocess_mode="mostrecent", registry=registry
        )
        doc = "Seconds one sync spent in each phase (slowest rank; engine/trace.py names them)."
        self.phases = histogram("sync_phase_seconds", doc, SECONDS, "phase")
        doc = "Refused or failed updates, by HTTP status."
        self.failures = Counter("vllm_delta:update_failures", doc, ["status"], registry=registry)

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


@functools.cache  # registered once per process, on first use (every caller is on the event loop)
def delta_metrics() -> DeltaMetrics:
    return DeltaMetrics()


def observed(result: dict[str, Any], what: str) -> dict[str, Any]:
    """A successful sync's answer, recorded and logged (every door)."""
    delta_metrics().observe(result)
    logger.info(
        "delta %s to version %d: %d changed, decode %.3fs, apply %.3fs, paused %.3fs",
        what,
        *(result[k] for k in ("version", "changed", "decode_s", "apply_s", "pause_s")),
    )
    return result


def refused(err: UpdateError, what: str, count: bool = True) -> UpdateError:
    """A door's refusal, logged, and counted when it is an update's."""
    logger.warning("delta %s refused (%d): %s", what, err.status, err.error["message"])
    if count:
        delta_metrics().failed(err.status)
    return err


async def answered(action: Awaitable[Any], what: str = "", count: bool = True) -> JSONResponse:
    """A door's answer: `action`'s, or its refusal's, logged (and counted) when `what` names it."""
    try:
        return JSONResponse(await action)
    except UpdateError as err:
        return (refused(err, what, count) if what else err).response()
