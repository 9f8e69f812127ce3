"""Publishing one capture: encode, write or broadcast, seal, push, and record the acks.

Runs on a background thread (one at a time) so it overlaps the trainer's next step. Multi-rank:
every rank encodes its own entries into its own flush files; rank 0 merges the manifests (shards
of one tensor become one entry whose counts and additive digests add up), seals, and pushes. With
a collective transport the other ranks' encoded flushes are first sent to rank 0, which broadcasts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from vllm_delta.client import EngineClient, Reply
from vllm_delta.sender.planner import Plan, Planner
from vllm_delta.sender.producer import Capture, Entry
from vllm_delta.sender.ranks import Ranks
from vllm_delta.transports.base import SentDelta
from vllm_delta.wire import FlushBuilder, Manifest, additive, merge_manifests

logger = logging.getLogger(__name__)


@dataclass
class Published:
    plan: Plan
    sent: list[SentDelta]
    replies: dict[str, Reply]
    all_acked: bool
    encode_s: float
    write_s: float  # time the disk writer spent writing (overlaps encoding)
    push_s: float  # from the push to the last engine's answer (engine prepare + apply)
    publish_s: float


def dir_name(kind: str, version: int) -> str:
    return f"v{version:06d}" + ("" if kind in ("delta", "catchup") else f"-{kind}")


class Publisher:
    def __init__(self, transport, client: EngineClient, planner: Planner, ranks: Ranks, *, flush_bytes: int) -> None:
        self.transport, self.client, self.planner, self.ranks = transport, client, planner, ranks
        self.flush_bytes = flush_bytes

    def run(self, plan: Plan, cap: Capture, model_elements: int) -> Published:
        start = time.perf_counter()
        sinks: list[tuple[str, FlushBuilder]] = []
        if plan.delta_urls and plan.kind:
            sinks.append((plan.kind, self._builder(plan.kind, plan.version, plan.base_version, plan.encoding,
                                                   model_elements)))
        if plan.anchor_urls:
            sinks.append(("anchor", self._builder("anchor", plan.version, None, self.planner.overwrite_encoding,
                                                  model_elements)))
        sent = [self._finish(kind, b, cap, {e.name: _add(b, e, kind) for e in cap.entries}, plan)
                for kind, b in sinks]
        encode_s = time.perf_counter() - start
        pushed = time.perf_counter()
        replies = self._push(plan, sent)
        push_s = time.perf_counter() - pushed
        # Rank 0 knows the engines; every rank's snapshot moves on its word.
        all_acked = self.ranks.bcast(self.planner.settle(plan, replies))
        write_s = sum(getattr(getattr(b, "writer", None), "write_s", 0.0) for _, b in sinks)
        return Published(plan, sent, replies, all_acked, encode_s, write_s, push_s, time.perf_counter() - start)

    def _builder(self, kind: str, version: int, base: int | None, encoding: str, model_elements: int) -> FlushBuilder:
        name = dir_name(kind, version)
        if self.ranks.rank == 0:
            self.transport.prepare(name)
        self.ranks.barrier()
        return self.transport.builder(name, version=version, base_version=base, encoding=encoding,
                                      flush_bytes=self.flush_bytes, rank=self.ranks.rank,
                                      model_elements=model_elements)

    def _finish(self, kind: str, b: FlushBuilder, cap: Capture, digests: dict[str, dict[str, str]],
                plan: Plan) -> SentDelta:
        """This rank's flushes are out; rank 0 gets the merged manifest with whole-tensor digests and
        the lineage the engines check before applying it."""
        manifest = _with_digests(b.manifest(), digests)
        self.transport.finish(b)
        full = {e.name: additive.to_hex(e.digests["digest"]) for e in cap.entries}
        parts = self.ranks.gather((manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes, full))
        if not self.transport.shared_files:
            self._gather_flushes(b, parts)
        mine = SentDelta(kind, manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes,
                         location=b.location, spool=getattr(b, "spool", None))
        if self.ranks.rank != 0:
            return mine
        merged = merge_manifests([p[0] for p in parts]) if len(parts) > 1 else manifest
        shards: dict[str, list[str]] = {}
        for p in parts:
            for name, h in p[4].items():
                shards.setdefault(name, []).append(h)
        merged = _with_digests(merged, {n: {"digest": additive.combine(*hs)} for n, hs in shards.items()})
        merged = merged.model_copy(update={"lineage": plan.lineage(kind)})
        out = SentDelta(kind, merged, len(b.files), sum(p[2] for p in parts), sum(p[3] for p in parts),
                        location=b.location, spool=mine.spool)
        self.transport.seal(out)
        return out

    def _gather_flushes(self, b: FlushBuilder, parts: list) -> None:
        """Collective transports: every other rank's flushes go to rank 0, which broadcasts them.

        Only encoded flushes move (changed entries, never whole weights), one flush in flight at a
        time, over the sender's own group; rank 0 keeps them in its bounded spool.
        """
        if self.ranks.size == 1:
            return
        if self.ranks.rank == 0:
            for src, part in enumerate(parts[1:], start=1):
                for f in part[0].files:
                    b.spool.add(f.name, self.ranks.recv_bytes(src))
        else:
            for _, data in b.spool:
                self.ranks.send_bytes(data, 0)
            b.spool.close()

    def _push(self, plan: Plan, sent: list[SentDelta]) -> dict[str, Reply]:
        replies: dict[str, Reply] = {}
        if self.ranks.rank == 0:
            self._replay(plan.replay)
            by_kind = {s.kind: s for s in sent}
            targets = {u: by_kind[plan.kind] for u in plan.delta_urls if plan.kind}
            targets.update({u: by_kind["anchor"] for u in plan.anchor_urls})
            if targets:
                replies = self.transport.push(self.client, {
                    u: (s, {"version": plan.version, "base_version": s.manifest.base_version})
                    for u, s in targets.items()})
            self.transport.cleanup(sent)
        return self.ranks.bcast(replies)


    def _replay(self, replay: dict[str, list[dict]]) -> None:
        """Late joiners first replay the store's kept chain, version by version, up to the last version
        sent; one that refuses a step stops there, and this plan's push tells where it stands."""
        pending = {u: list(steps) for u, steps in replay.items() if steps}
        while pending:
            replies = self.client.update({u: steps[0] for u, steps in pending.items()})
            for u, r in replies.items():
                step = pending[u].pop(0)
                if not (r.ok and r.body.get("version") == step["version"]):
                    logger.warning("delta sender: %s refused catch-up version %d (%s): %s", u, step["version"],
                                   r.status, r.error)
                    pending[u] = []
            pending = {u: s for u, s in pending.items() if s}


def _add(b: FlushBuilder, e: Entry, kind: str) -> dict[str, str]:
    """Queue one entry; returns this rank's partial digests of what it listed."""
    if kind == "anchor":
        b.add(e.name, e.anchor_positions, e.anchor_values, None, shape=e.full_shape, post_hash=e.post_hash)
        return {"post_digest": additive.to_hex(e.digests["digest"])}
    if not e.positions.numel():
        return {}
    b.add(e.name, e.positions, e.new_values, e.old_values if b.encoding.needs_base else None,
          shape=e.full_shape, post_hash=e.post_hash)
    # pre_digest pins the values the delta applies to; only a base-relative delta (pinned to its
    # base version anyway) may carry it, so an overwrite delta stays safe to replay.
    return {k: additive.to_hex(v) for k, v in e.digests.items()
            if k == "post_digest" or (k == "pre_digest" and b.encoding.needs_base)}


def _with_digests(m: Manifest, digests: dict[str, dict[str, str]]) -> Manifest:
    """The manifest with digests set on the entries it lists."""
    return m.model_copy(update={"params": [p.model_copy(update=digests.get(p.name, {})) for p in m.params]})
