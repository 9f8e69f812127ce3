"""Syncs under load: completion streams run against a real engine while a trainer syncs it.

Why: a weight update decides what a production model says, and it happens while the model
serves. This drives N concurrent completion streams, measures their latency with and without
syncing, counts failed requests, and after every sync checks the chain from the trainer to the
served weights: the xxh3-128 of each trainer tensor's bytes, computed here with plain `xxhash`
(not with vllm_delta's digest code), equals the `post_hash` the update states for it, and the
engine's full verify finds every served tensor (one engine, TP=1: each held whole) hashing to
what the updates stated and its additive digests matching.
"""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch
import xxhash
from safetensors.torch import load_file

from harness.perturb import perturb_tensor
from vllm_delta import DeltaSender
from vllm_delta.sender.publisher import dir_name
from vllm_delta.wire import MANIFEST_NAME


@dataclass
class Load:
    """`streams` threads issuing greedy completions back to back; latencies tagged by phase."""

    url: str
    api_key: str
    streams: int
    phase: str = "baseline"
    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(self.streams):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, i: int) -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {self.api_key}"
        k = 0
        while not self._stop.is_set():
            body = {"prompt": f"stream {i} request {k}: the", "max_tokens": 8, "temperature": 0}
            phase, t0 = self.phase, time.perf_counter()
            try:
                r = session.post(f"{self.url}/v1/completions", json=body, timeout=120)
                ok = r.status_code == 200 and len(r.json()["choices"]) == 1
                if not ok:
                    self.failures.append(f"{r.status_code}: {r.text[:200]}")
            except requests.RequestException as exc:
                self.failures.append(f"{phase}, {time.monotonic():.1f}: {exc!r}")
                ok = False
            if ok:
                self.latencies.setdefault(phase, []).append(time.perf_counter() - t0)
            k += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def _xxh3(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes in row-major order (what the wire format's post_hash means)."""
    return xxhash.xxh3_128_hexdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_soak(
    url: str,
    api_key: str,
    model_dir: Path,
    root: Path,
    *,
    syncs: int,
    streams: int = 8,
    baseline_s: float = 10.0,
    density: float = 0.02,
    seed: int = 0,
) -> dict:
    """Baseline load, then `syncs` syncs under the same load; returns the figures."""
    headers = {"Authorization": f"Bearer {api_key}"}
    version = requests.get(f"{url}/delta_updates/status", headers=headers, timeout=60).json()["version"]
    weights = dict(load_file(model_dir / "model.safetensors"))
    sender = DeltaSender(
        [url], "disk", root, api_key=api_key, flush_bytes=64 << 10, version=version, keep=True, post_hash=True
    )  # the stated xxh3 is what this soak checks
    sender.seed(weights)
    load = Load(url, api_key, streams)
    load.start()
    time.sleep(baseline_s)
    load.phase = "syncing"
    gen = torch.Generator().manual_seed(seed)
    pauses, sync_s, verified, chain_errors = [], [], 0, []
    try:
        for _ in range(syncs):
            weights = {n: perturb_tensor(t, density, gen) for n, t in weights.items()}
            m = sender.sync(weights)
            if m["sender/all_acked"] != 1.0:
                chain_errors.append(f"v{int(m['sender/version'])}: not acked: {sender.engines}")
                continue
            pauses.append(m["perf/update_weights_engine_pause_time"])
            sync_s.append(m["perf/update_weights_time"])
            kind = "anchor" if m["sender/anchors"] else "delta"  # an engine new to this run is anchored first
            vdir = root / dir_name(kind, int(m["sender/version"]))
            manifest = json.loads((vdir / MANIFEST_NAME).read_text())
            trainer = {n: _xxh3(t) for n, t in weights.items()}
            stated = {p["name"]: p.get("post_hash") for p in manifest["params"]}
            engine = requests.post(f"{url}/delta_updates/verify", headers=headers, timeout=300).json()
            if stated != trainer or not engine.get("ok") or engine.get("hashes_checked") != len(trainer):
                wrong = sorted(n for n in trainer.keys() | stated.keys() if stated.get(n) != trainer.get(n))
                chain_errors.append(
                    f"v{manifest['version']}: stated hashes differ from the trainer's for {wrong[:5]}, "
                    f"engine {engine}"
                )
            else:
                verified += 1
            shutil.rmtree(vdir)
    finally:
        load.stop()
        sender.close()
    base, busy = load.latencies.get("baseline", []), load.latencies.get("syncing", [])
    return {
        "syncs": syncs,
        "syncs_verified": verified,
        "chain_errors": chain_errors,
        "streams": streams,
        "requests": len(base) + len(busy) + len(load.failures),
        "requests_failed": len(load.failures),
        "failures": load.failures[:5],
        "latency_baseline": {"n": len(base), "p50": _pct(base, 0.5), "p99": _pct(base, 0.99)},
        "latency_syncing": {
            "n": len(busy),
            "p50": _pct(busy, 0.5),
            "p99": _pct(busy, 0.99),
            "max": max(busy, default=float("nan")),
        },
        "pause_s": {
            "median": statistics.median(pauses) if pauses else float("nan"),
            "max": max(pauses, default=0.0),
        },
        "sync_s": {"median": statistics.median(sync_s) if sync_s else float("nan")},
    }
