"""Publishing one capture: encode, write or broadcast, seal, push, and record the acks, on a background
thread. Every rank encodes its own entries; rank 0 merges the manifests (a tensor's shards become one
entry whose counts and additive digests add up), seals and pushes."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from vllm_delta.client import EngineClient, Reply
from vllm_delta.sender.capture import Capture, Entry
from vllm_delta.sender.planner import Plan, Planner
from vllm_delta.transports.base import SentDelta, Sink, Transport
from vllm_delta.transports.collective import FlushSpool
from vllm_delta.wire import FlushBuilder, Manifest, additive, merge_manifests
from vllm_delta.wire.signing import sign

logger = logging.getLogger(__name__)


def dir_name(kind: str, version: int) -> str:
    return f"v{version:06d}" + ("" if kind in ("delta", "catchup") else f"-{kind}")


class Publisher:
    def __init__(
        self,
        transport: Transport,
        client: EngineClient,
        planner: Planner,
        ranks: Ranks,
        *,
        flush_bytes: int,
        signing_keys: list[bytes],
    ) -> None:
        self.transport, self.client, self.planner, self.ranks = transport, client, planner, ranks
        # the first of `signing_keys` signs each merged manifest (wire/signing.py)
        self.flush_bytes, self.signing_keys = flush_bytes, signing_keys

    def run(self, plan: Plan, cap: Capture, model_elements: int, changed: int) -> dict[str, float]:
        """The publish's metrics (`changed`: elements, every rank). Every rank runs the same collectives
        whatever fails on it: a local failure is agreed on and raised on every rank at one point; rank
        0's (seal, push) travel in the outcome it broadcasts."""
        start = time.perf_counter()
        rank0 = self.ranks.rank == 0
        kinds = []
        if plan.delta_urls and plan.kind:
            kinds.append((plan.kind, plan.base_version, plan.encoding))
        if plan.anchor_urls:
            kinds.append(("anchor", None, self.planner.overwrite_encoding))
        dirs = [dir_name(k, plan.version) for k, _, _ in kinds]
        self._agreed(lambda: [self.transport.prepare(d) for d in dirs] if rank0 else None, "prepare")
        opts = {"version": plan.version, "flush_bytes": self.flush_bytes, "model_elements": model_elements}
        sent: list[SentDelta] = []
        sinks: list[Sink] = []
        failure: BaseException | None = None
        cleaned = False
        try:
            for d, (kind, base, encoding) in zip(dirs, kinds):
                sink = self.transport.sink(
                    d, base_version=base, encoding=encoding, rank=self.ranks.rank, **opts
                )
                sinks.append(sink)
                manifest = self._agreed(lambda sink=sink, kind=kind: self._encode(sink, kind, cap), "encode")
                out, err = self._finish(kind, sink, manifest, cap, plan)
                sent.append(out)
                failure = failure or err
            encode_s = time.perf_counter() - start
            pushed = time.perf_counter()
            replies, all_acked = {}, False
            if rank0 and failure is None:
                try:  # a failed push or cleanup is rank 0's outcome, broadcast below
                    try:
                        replies = self._push(plan, sent)
                    finally:
                        cleaned = self._cleanup(sinks, sent)
                    all_acked = self.planner.settle(plan, replies)
                    self.planner.probe_unknown()
                except Exception as exc:
                    failure = exc
            push_s = time.perf_counter() - pushed
        finally:
            if not cleaned:
                self._cleanup(sinks, sent)
        # Rank 0 knows the engines; every rank's snapshot moves on its word, or none does.
        replies, all_acked, error = self.ranks.bcast((replies, all_acked, describe(failure)))
        if failure is not None:  # rank 0's own error, as it was
            raise failure
        if error is not None:
            raise PublishError(f"rank 0: {error}")
        if not rank0:  # every rank's planner keeps the versions (rank 0's word decides)
            self.planner.settle(plan, replies)
        post = sum(s.wire_bytes for s in sent) if rank0 else 0
        pre = sum(s.pre_compress_bytes for s in sent) if rank0 else 0
        wire = post
        if not self.transport.stored:  # a broadcast moves the bytes once per engine
            per = {s.kind: s.wire_bytes for s in sent}
            wire = per.get(plan.kind, 0) * len(plan.delta_urls) + per.get("anchor", 0) * len(plan.anchor_urls)
        ok = [r.body for r in replies.values() if r.ok]
        engines = self.planner.engines.values()
        return {
            "perf/update_weights_density": changed / max(1, model_elements),
            "perf/update_weights_wire_bytes": float(wire),
            "perf/update_weights_disk_bytes_pre_compress": float(pre),
            "perf/update_weights_disk_bytes_post_compress": float(post),
            "perf/update_weights_compression_ratio": pre / max(1, post),
            "sender/encode_s": encode_s,
            "sender/write_s": sum(s.writer.write_s for s in sinks if s.writer is not None),
            "sender/push_s": push_s,
            "sender/publish_s": time.perf_counter() - start,
            "perf/update_weights_flushes_per_rank": float(max((s.flushes for s in sent), default=0)),
            "perf/update_weights_engine_pause_time": max((b.get("pause_s", 0.0) for b in ok), default=0.0),
            "perf/update_weights_engine_apply_time": max((b.get("apply_s", 0.0) for b in ok), default=0.0),
            "perf/update_weights_engine_decode_time": max((b.get("decode_s", 0.0) for b in ok), default=0.0),
            "sender/version": float(plan.version),
            "sender/snapshot_version": float(self.planner.snapshot_version),
            "sender/changed_elements": float(changed),
            "sender/engines_acked": float(sum(r.ok for r in replies.values())),
            "sender/engines_failed": float(len(engines) - sum(e.acked == plan.version for e in engines)),
            "sender/anchors": float(len(plan.anchor_urls)),
            "sender/catchup": float(plan.kind == "catchup"),
            "sender/all_acked": float(all_acked),
        }

    def _cleanup(self, sinks: list[Sink], sent: list[SentDelta]) -> bool:
        """Rank 0 drops what this publish put on the wire; a sink never sent only closes its spool."""
        if self.ranks.rank == 0:
            self.transport.cleanup(sent)
        for s in sinks[len(sent) :]:
            if s.spool is not None:
                s.spool.close()
        return True

    def _agreed(self, step, what: str):
        """`step()` on this rank, then agree: if it failed on any rank, every rank raises at this point."""
        result, failure = None, None
        try:
            result = step()
        except Exception as exc:
            failure = exc
            logger.warning("delta sender: %s failed on rank %d: %s", what, self.ranks.rank, exc)
        if self.ranks.any(failure is not None):
            if failure is not None:  # this rank's own error, as it was; the others raise PublishError
                raise failure
            raise PublishError(f"{what} failed on another sender rank")
        return result

    def _encode(self, sink: Sink, kind: str, cap: Capture) -> Manifest:
        """This rank's entries into the sink's flushes; its manifest, with this rank's partial digests."""
        try:
            digests = {e.name: _add(sink.builder, e, kind) for e in cap.entries}
            manifest = _with_digests(sink.builder.manifest(), digests)
        finally:
            self.transport.finish(sink)  # a writer thread always ends; its error (if any) is raised here
        return manifest

    def _finish(
        self, kind: str, sink: Sink, manifest: Manifest, cap: Capture, plan: Plan
    ) -> tuple[SentDelta, BaseException | None]:
        """Rank 0 merges the manifests, adds whole-tensor digests and the lineage, signs and seals."""
        full = {e.name: additive.to_hex(e.digests["digest"]) for e in cap.entries}
        b = sink.builder
        parts = self.ranks.gather((manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes, full))
        if sink.spool is not None:
            self._gather_flushes(sink.spool, parts)
        mine = SentDelta(
            kind, manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes, sink.location, sink.spool
        )
        if self.ranks.rank != 0:
            return mine, None
        merged = merge_manifests([p[0] for p in parts]) if len(parts) > 1 else manifest
        shards: dict[str, list[str]] = {}
        for p in parts:
            for name, h in p[4].items():
                shards.setdefault(name, []).append(h)
        merged = _with_digests(merged, {n: {"digest": additive.combine(*hs)} for n, hs in shards.items()})
        merged = merged.model_copy(update={"lineage": plan.lineage(kind)})
        if self.signing_keys:  # last: the signature covers the lineage and every digest
            merged = sign(merged, self.signing_keys)
        wire, pre = sum(p[2] for p in parts), sum(p[3] for p in parts)
        out = replace(mine, manifest=merged, wire_bytes=wire, pre_compress_bytes=pre)
        try:
            self.transport.seal(out)
        except Exception as exc:
            return out, exc
        return out, None

    def _gather_flushes(self, spool: FlushSpool, parts: list) -> None:
        """Collective transports: the other ranks' flushes to rank 0's bounded spool, one at a time."""
        if self.ranks.rank == 0:
            for src, part in enumerate(parts[1:], start=1):
                for f in part[0].files:
                    spool.add(f.name, self.ranks.recv_bytes(src))
        else:
            for _, data in spool:
                self.ranks.send_bytes(data, 0)
            spool.close()

    def _push(self, plan: Plan, sent: list[SentDelta]) -> dict[str, Reply]:
        """Rank 0: the kept chain's replays, then this plan's update to every target engine."""
        self._replay(plan.replay)
        by_kind = {
            s.kind: (s, {"version": plan.version, "base_version": s.manifest.base_version}) for s in sent
        }
        targets = {u: by_kind[plan.kind] for u in plan.delta_urls if plan.kind}
        targets.update({u: by_kind["anchor"] for u in plan.anchor_urls})
        return self.transport.push(self.client, targets) if targets else {}

    def _replay(self, replay: dict[str, list[dict]]) -> None:
        """Late joiners replay the store's kept chain version by version; one that refuses a step stops."""
        pending = {u: list(steps) for u, steps in replay.items() if steps}
        while pending:
            replies = self.client.update({u: steps[0] for u, steps in pending.items()})
            for u, r in replies.items():
                v = pending[u].pop(0)["version"]
                if not (r.ok and r.body.get("version") == v):
                    logger.warning(
                        "delta sender: %s refused catch-up version %d (%s): %s", u, v, r.status, r.error
                    )
                    pending[u] = []
            pending = {u: s for u, s in pending.items() if s}


class PublishError(RuntimeError):
    """A publish failed on some sender rank; every rank raised it at the same point."""


def describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _add(b: FlushBuilder, e: Entry, kind: str) -> dict[str, str]:
    """Queue one entry; returns this rank's partial digests of what it listed."""
    if kind == "anchor":
        b.add_dense(e.name, e.anchor.pieces(b.flush_bytes), shape=e.full_shape, post_hash=e.post_hash)
        return {"post_digest": additive.to_hex(e.digests["digest"])}
    if not e.positions.numel():
        return {}
    old = e.old_values if b.encoding.needs_base else None
    b.add(
        e.name,
        e.positions,
        e.new_values,
        old,
        shape=e.full_shape,
        post_hash=e.post_hash,
        _from_scan=e.scanned,
    )
    # pre_digest pins the values the delta applies to; only a base-relative delta (pinned to its
    # base version anyway) may carry it, so an overwrite delta stays safe to replay.
    keep = ("post_digest", "pre_digest") if b.encoding.needs_base else ("post_digest",)
    return {k: additive.to_hex(v) for k, v in e.digests.items() if k in keep}


def _with_digests(m: Manifest, digests: dict[str, dict[str, str]]) -> Manifest:
    """The manifest with digests set on the entries it lists."""
    return m.model_copy(update={"params": [p.model_copy(update=digests.get(p.name, {})) for p in m.params]})


class Ranks:
    """Multi-rank plumbing (no-ops for one rank) on a group of the sender's own: the publish thread's
    collectives and the trainer's would interleave differently on different ranks on one group."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)

    def bcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list:
        """Every rank's `obj` on rank 0 (an empty list elsewhere)."""
        if self.group is None:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out if self.rank == 0 else []

    def any(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set: called by every rank at one point, so a step that failed on
        one rank ends on all of them instead of leaving the others waiting in the next collective."""
        return self.all_sum(int(bool(flag))) > 0

    def all_sum(self, n: int) -> int:
        if self.group is None:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t[0])

    def send_bytes(self, data: bytes, dst: int) -> None:
        """Point-to-point bytes to group rank `dst` (its size first), for `recv_bytes`."""
        peer = dist.get_global_rank(self.group, dst)
        dist.send(torch.tensor([len(data)], dtype=torch.int64), peer, group=self.group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, group=self.group)

    def recv_bytes(self, src: int) -> bytes:
        """What group rank `src` sent with `send_bytes`."""
        peer = dist.get_global_rank(self.group, src)
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, peer, group=self.group)
        out = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(out, peer, group=self.group)
        return out.numpy().tobytes()
