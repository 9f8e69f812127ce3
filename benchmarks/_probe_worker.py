"""Worker-side half of `benchmarks/probe.py` (sent by name through `collective_rpc`)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from benchmarks._apply_worker import PeakRss


def probe(worker) -> dict[str, Any]:
    """The route's startup probe (`delta_probe`), with the worker's own peak RSS around it."""
    with PeakRss() as m:
        status = worker.delta_probe()
    return {
        "seconds": m.seconds,
        "extra": m.extra,
        "probe_s": status["probe_s"],
        "probe_peak_bytes": status["probe_peak_bytes"],
        "fallback": status["fallback"],
    }


def load_module(path: str) -> Any:
    """An earlier placement.py, imported from a file."""
    spec = importlib.util.spec_from_file_location("old_placement", path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up there
    spec.loader.exec_module(old)
    return old


def segments(placements: dict) -> dict[str, list[tuple]]:
    """Every segment as plain data, to compare two probes' results."""
    return {
        n: [(s.target, s.sizes, s.src_offset, s.src_strides, s.dst_offset, s.dst_strides) for s in p.segments]
        for n, p in placements.items()
    }


def old_probe(worker, path: str) -> dict[str, Any]:
    """An earlier placement module's `build_placement` on the same live parameters."""
    old = load_module(path)
    applier = worker._delta().applier
    storages = applier._storages()  # the names the applier's own probe records into
    with PeakRss() as m:
        placements = old.build_placement(applier._load_weights, storages, applier.checkpoint)
    same = segments(placements) == segments(applier.placements)
    return {
        "seconds": m.seconds,
        "extra": m.extra,
        "fallback": {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason},
        "same_segments_as_new": same,
    }
