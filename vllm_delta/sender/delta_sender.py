"""`DeltaSender`: diff against a snapshot, encode, move, and advance only when every engine acknowledged.
`capture()` returns once the optimizer may touch the weights again; `publish()` runs on a background
thread. A failed publish never stops training: it is recorded and agreed on by every rank; only `sync()`
raises it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from vllm_delta import settings
from vllm_delta.client import EngineClient
from vllm_delta.kernels.warmup import warm_up
from vllm_delta.sender.capture import Capture
from vllm_delta.sender.fp8_quant import SCALE, BlockFp8Quantizer
from vllm_delta.sender.planner import EngineState, Plan, Planner
from vllm_delta.sender.producer import Producer
from vllm_delta.sender.publisher import Publisher, Ranks, describe
from vllm_delta.sender.shards import Segments, Shard, check_disjoint
from vllm_delta.transports import base as transports
from vllm_delta.transports.base import TransportOptions
from vllm_delta.wire.checkpoint import Checkpoint
from vllm_delta.wire.signing import signing_keys as checked_keys

logger = logging.getLogger(__name__)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor] | Shard]


def _shards(named: NamedTensors) -> list[Shard | Segments]:
    items = named.items() if isinstance(named, Mapping) else named
    return [x if isinstance(x, (Shard, Segments)) else Shard.whole(x[0], x[1].detach()) for x in items]


def checkpoint_seed(
    hf_dir: str | Path, names: Iterable[str] | None, like: list[Shard | Segments] | None
) -> tuple[Iterable, BlockFp8Quantizer | None]:
    """(what to seed, the block-fp8 quantizer or None): whole tensors (all, or the named ones and their
    block scales), or with `like` each shard's elements of the checkpoint, on that shard's device."""
    ckpt = Checkpoint.open(hf_dir)
    if like is None:
        if names is None:
            return ckpt.iter_tensors(), BlockFp8Quantizer.served(ckpt)
        wanted = list(dict.fromkeys(names))  # only the named tensors' shards are opened
        fp8 = BlockFp8Quantizer.served(ckpt, [n for n in wanted if n in ckpt])
        wanted += [n + SCALE for n in wanted if fp8 and n in fp8.names]
        return ((n, ckpt.read(n)) for n in wanted if n in ckpt), fp8
    if missing := sorted({s.name for s in like if s.name not in ckpt}):
        raise KeyError(f"not in the checkpoint: {missing[:5]}")
    fp8 = BlockFp8Quantizer.served(ckpt, [s.name for s in like])
    scales = fp8.scale_parts(like) if fp8 else []  # this rank's blocks' scales

    def part(s: Shard | Segments) -> torch.Tensor:  # segments by their runs: no per-element index
        got = (
            ckpt.read_runs(s.name, s.runs)
            if isinstance(s, Segments)
            else ckpt.read_at(s.name, s.global_index().cpu())
        )
        return got.reshape(s.tensor.shape).to(s.tensor.device)

    return [s.with_tensor(part(s)) for s in like + scales], fp8


def _failure_metrics(plan: Plan) -> dict[str, float]:
    return {"sender/publish_failed": 1.0, "sender/all_acked": 0.0, "sender/version": float(plan.version)}


def _alias_key(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


class DeltaSender:
    """The trainer's side of delta sync; docs/sender.md describes every argument. `group` (a gloo
    group of the sender's own, `publisher.Ranks`) makes it multi-rank: each rank passes what it holds, rank 0
    talks to the engines. `signing_keys` None reads them from the environment (`settings.py`)."""

    def __init__(
        self,
        engines: list[str],
        transport: str = "disk",
        delta_dir: str | Path | None = None,
        *,
        encoding: str = "ulp_zstd",
        overwrite_encoding: str = "planes_zstd",
        api_key: str | None = None,
        flush_bytes: int = 512 << 20,
        anchor_every: int | None = None,
        keep: bool = False,
        post_hash: bool = False,
        timeout_s: float = 600.0,
        retries: int = 3,
        master_addr: str = "127.0.0.1",
        collective_timeout_s: float = 120.0,
        group: Any = None,
        throttle_bytes_per_s: float | None = None,
        version: int = 0,
        snapshot: str = "auto",
        max_lag_syncs: int = 3,
        max_pending_density: float = 0.1,
        client: Any = None,
        status_wait_s: float = 0.0,
        signing_keys: Sequence[str | bytes] | None = None,
    ) -> None:
        # Anything with EngineClient's `status`/`update`/`collective_init` may stand in for HTTP.
        self.client = client or EngineClient(api_key, timeout_s=timeout_s, retries=retries)
        self.planner = Planner(
            engines, self.client, encoding, overwrite_encoding, anchor_every, version, max_lag_syncs
        )
        self.transport = transports.create(
            transport,
            TransportOptions(
                delta_dir=delta_dir,
                keep=keep,
                throttle_bytes_per_s=throttle_bytes_per_s,
                version=version,
                master_addr=master_addr,
                collective_timeout_s=collective_timeout_s,
                planner=self.planner,
            ),
        )
        self.planner.catch_up = self.transport.catch_up
        self.max_pending_density = max_pending_density
        self.producer = Producer(snapshot=snapshot, post_hash=post_hash)
        self.ranks = Ranks(group)
        keys = checked_keys(settings.signing_keys() if signing_keys is None else signing_keys)
        self.publisher = Publisher(
            self.transport, self.client, self.planner, self.ranks, flush_bytes=flush_bytes, signing_keys=keys
        )
        self.model_elements = 0
        self.fp8: BlockFp8Quantizer | None = None  # a block-fp8 served checkpoint's (fp8_quant.py)
        self.status_wait_s = status_wait_s
        self.publish_failures = 0
        self.last_error: BaseException | None = None  # the last failed publish's error
        self._publish_error: BaseException | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-publish")
        self._inflight: tuple[Capture, Plan, Future] | None = None
        self._staged: tuple[Capture, Plan] | None = None
        self._capture_metrics: dict[str, float] = {}
        self.last_wait_s = 0.0  # how long the last capture() waited for the previous publish

    @property
    def engines(self) -> dict[str, EngineState]:
        return self.planner.engines

    @property
    def version(self) -> int:
        return self.planner.version

    @property
    def snapshot_version(self) -> int:
        return self.planner.snapshot_version

    def seed(self, named: NamedTensors) -> None:
        """The snapshot: the engines' weights at `version`, for the tensors or shards this rank holds."""
        shards = _shards(named)
        warm_up({s.tensor.dtype for s in shards}, engine=False, sender=True)  # no compile in the first sync
        self.producer.seed(shards)
        placements = self.ranks.gather(self.producer.placements())
        coverage = self.ranks.bcast(
            check_disjoint(p for part in placements for p in part) if self.ranks.rank == 0 else None
        )
        if partial := [n for n, c in coverage.items() if c < 1.0]:
            logger.warning(
                "delta sender: no rank holds all of %d tensors (e.g. %s); their missing parts are never sent",
                len(partial),
                partial[:3],
            )
        self.model_elements = self.ranks.all_sum(self.producer.elements)

    def seed_from_checkpoint(
        self, hf_dir: str | Path, names: Iterable[str] | None = None, like: NamedTensors | None = None
    ) -> None:
        """Seed from the engines' own HF checkpoint bytes (exact even if the trainer's round trip isn't);
        with `like` (what this rank will capture), only this rank's elements are read."""
        seeded, fp8 = checkpoint_seed(hf_dir, names, None if like is None else _shards(like))
        self.seed(seeded)
        self.fp8 = fp8

    def add_engine(self, url: str) -> None:
        """A late-joining (or restarted) engine: a full anchor at the next sync (or s3's kept chain)."""
        self.wait()
        self.planner.add_engine(url)

    def remove_engine(self, url: str) -> None:
        self.wait()
        self.planner.engines.pop(url, None)
        self.transport.close(url)

    def request_anchor(self) -> None:
        """Send every engine a full anchor at the next sync."""
        self.planner.anchor_next = True

    def status(self) -> dict[str, Any]:
        """What went wrong lately, for a trainer's logs: failed publishes and each engine's state."""
        return {
            "publish_failures": self.publish_failures,
            "last_error": describe(self.last_error),
            "engines": {
                u: {k: getattr(e, k) for k in ("acked", "needs_anchor", "skipped", "last_error")}
                for u, e in self.planner.engines.items()
            },
        }

    def capture(self, named: NamedTensors) -> Capture:
        """Diff and stage the changes; the weights may change again when this returns."""
        return self._capture(named, self.status_wait_s)

    def _capture(self, named: NamedTensors, status_wait_s: float | None) -> Capture:
        if not self.producer.names and self.ranks.size == 1:
            raise RuntimeError("seed() or seed_from_checkpoint() first")
        if self._staged is not None:
            raise RuntimeError("publish() the previous capture first")
        t = time.perf_counter()
        self.wait()
        self.last_wait_s = time.perf_counter() - t
        start = time.perf_counter()
        plan = self.ranks.bcast(self.planner.plan(status_wait_s) if self.ranks.rank == 0 else None)
        cap = self.producer.scan(
            self._given(named), kind=plan.kind if plan.delta_urls else "", anchor=bool(plan.anchor_urls)
        )
        self._staged = (cap, plan)
        self._capture_metrics = {
            "sender/capture_s": time.perf_counter() - start,
            "sender/scan_s": cap.scan_s,
            "sender/stage_s": cap.stage_s,
            "sender/capture_wait_s": self.last_wait_s,
        }
        return cap

    def publish(self) -> Future:
        """Encode, move and push the last capture in the background; the future gives the metrics."""
        if self._staged is None:
            raise RuntimeError("capture() first")
        cap, plan = self._staged
        self._staged = None
        changed = self.ranks.all_sum(cap.changed)
        captured = dict(self._capture_metrics)
        future = self._executor.submit(self._publish, plan, cap, changed, captured)
        self._inflight = (cap, plan, future)
        return future

    def sync(self, named: NamedTensors) -> dict[str, float]:
        """Capture, publish and wait (for engines' status answers too); raises a failed publish's error."""
        self._capture(named, None)
        self.publish()
        metrics = self.wait()
        if metrics.get("sender/publish_failed"):
            raise self.last_error
        return metrics

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self.transport.close()

    def _publish(
        self, plan: Plan, cap: Capture, changed: int, captured: dict[str, float]
    ) -> dict[str, float]:
        """The publish thread: its metrics; an error is kept for `wait`, never raised to `future.result()`."""
        try:
            uploaded = self.transport.uploaded_bytes
            metrics = {**self.publisher.run(plan, cap, self.model_elements, changed), **captured}
            if uploaded is not None:  # every object this sync PUT, from every rank: one delta's bytes
                metrics["perf/update_weights_upload_bytes"] = float(
                    self.ranks.all_sum(self.transport.uploaded_bytes - uploaded)
                )
            metrics["perf/update_weights_time"] = captured["sender/capture_s"] + metrics["sender/publish_s"]
            metrics["perf/delta_encode_time"] = captured["sender/scan_s"] + metrics["sender/encode_s"]
            metrics["sender/publish_failed"] = 0.0
            return metrics
        except Exception as exc:  # one publish runs at a time: `wait` takes it from here
            self._publish_error = exc
            return {**captured, **_failure_metrics(plan)}

    def wait(self) -> dict[str, float]:
        """Wait for the publish in flight and apply its outcome; its metrics (a failure: never raised,
        `sender/publish_failed` is 1 and `last_error` says why)."""
        if self._inflight is None:
            return {}
        cap, plan, future = self._inflight
        self._inflight = None
        metrics = dict(future.result())
        error, self._publish_error = self._publish_error, None
        try:  # every rank calls this collective, whatever its publish did: the outcome is agreed on
            failed = self.ranks.any(error is not None)
        except Exception as exc:  # the sender's group itself broke
            failed, error = True, error or exc
        if failed:
            return self._failed(cap, plan, metrics, error)
        (self.producer.advance if metrics["sender/all_acked"] else self.producer.defer)(cap)
        density = self.ranks.all_sum(self.producer.pending_elements()) / max(1, self.model_elements)
        dropped: list[str] = []
        if density > self.max_pending_density:  # a catch-up this dense costs more than anchoring the laggards
            dropped = self.planner.drop_lagging(plan.version, f"pending catch-up at {density:.1%} density")
            self.producer.advance(cap)  # diff(N, S) covers every change since S: the snapshot is at N
            density = 0.0
        metrics["sender/pending_density"] = density
        metrics["sender/dropped_to_anchor"] = float(len(dropped))
        return metrics

    def _failed(
        self, cap: Capture, plan: Plan, metrics: dict[str, float], error: BaseException | None
    ) -> dict[str, float]:
        """A publish that failed on some rank: no snapshot moves, the changes stay pending, and the
        plan's engines are in an unknown state until their status (asked in the background) says."""
        error = error or RuntimeError("the publish failed on another sender rank")
        self.publish_failures += 1
        self.last_error = error
        logger.error(
            "delta sender: publishing version %d failed (training goes on): %s", plan.version, describe(error)
        )
        for url in plan.delta_urls + plan.anchor_urls:
            e = self.planner.engines.get(url)
            if e is not None:
                e.acked = None
                e.last_error = {"type": "PublishFailed", "message": describe(error)}
        self.planner.version = max(self.planner.version, plan.version)
        if self.ranks.rank == 0:
            self.planner.probe_unknown()
        self.producer.defer(cap)
        return {**metrics, **_failure_metrics(plan), "sender/publish_failures": float(self.publish_failures)}

    def _given(self, named: NamedTensors) -> list[Shard]:
        """The shards to scan; a tensor tied to a seeded one (lm_head, embed_tokens) is sent once, seeded."""
        shards = _shards(named)
        known = set(self.producer.names)
        seeded = {_alias_key(s.tensor) for s in shards if s.name in known}
        out = [s for s in shards if s.name in known or _alias_key(s.tensor) not in seeded]
        return self.fp8.apply(out) if self.fp8 else out
