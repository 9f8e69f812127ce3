"""`DeltaSender`: any trainer hands its HF-named weights over after a step; engines stay bit-exact.

Why the snapshot moves only on a full ack: the seed advanced it before the engines applied, so a
failed apply was never re-sent and that engine drifted for good. Here the snapshot stays at S, the
last version every engine acknowledged. While some engine lags, the sender remembers the positions
it sent since S (`pending`) and sends everyone an *overwrite* catch-up delta: current values at
diff(current, S) ∪ pending. Any engine whose weights are some version in [S, N-1] of this
lineage ends exactly at N after applying it (a position that differs between its version and N
was changed since S, so it is in one of the two sets), and an overwrite delta is safe to replay.
Engines outside the lineage (restarted at version 0, pushed ahead by someone else, newly added)
get a full anchor. In the steady state (every engine at S) the configured, base-relative encoding
(`ulp_zstd`) is used. docs/sender.md has the state machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_delta.client import EngineClient, Reply
from vllm_delta.diff import changed_positions
from vllm_delta.transports.base import SentDelta
from vllm_delta.wire import FlushBuilder, get_encoding, tensor_digest

logger = logging.getLogger(__name__)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
TRANSPORTS = ("disk", "gloo", "nccl")


@dataclass
class EngineState:
    """What the sender knows of one engine."""

    url: str
    acked: int | None = 0  # last version it acknowledged; None: unknown (ask its status first)
    needs_anchor: bool = False
    last_error: dict[str, Any] | None = None
    last_status: int | None = None
    skipped: bool = False  # unreachable or dirty at plan time: not sent to this sync


@dataclass
class Plan:
    version: int
    kind: str  # "delta" (base-relative from S, everyone at S) | "catchup" (overwrite) | "" (none)
    encoding: str
    base_version: int | None
    delta_urls: list[str] = field(default_factory=list)
    anchor_urls: list[str] = field(default_factory=list)


def _items(named: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(named.items()) if isinstance(named, Mapping) else iter(named)


def _union(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    if a is None or a.numel() == 0:
        return b
    if b.numel() == 0:
        return a
    return torch.unique(torch.cat([a, b]), sorted=True)


class DeltaSender:
    """Diff against a snapshot, encode, move, and advance only when every engine acknowledged.

    `engines` are base URLs. With `transport="disk"`, each engine's `--delta-updates-root` must be
    `delta_dir` (as the engine mounts it): requests name version directories relative to it. With
    `"gloo"`/`"nccl"`, each engine joins a small process group with this process as rank 0.
    `group` (a torch.distributed gloo group) makes this a multi-rank sender (disk only): each rank
    passes the tensors it owns, rank 0 merges the manifests and talks to the engines.
    """

    def __init__(self, engines: list[str], transport: str = "disk", delta_dir: str | Path | None = None, *,
                 encoding: str = "ulp_zstd", overwrite_encoding: str = "planes_zstd", api_key: str | None = None,
                 flush_bytes: int = 512 << 20, anchor_every: int | None = None, keep: bool = False,
                 post_hash: bool = True, timeout_s: float = 600.0, retries: int = 3,
                 master_addr: str = "127.0.0.1", collective_timeout_s: float = 120.0,
                 group: Any = None, throttle_bytes_per_s: float | None = None, version: int = 0) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        if transport == "disk" and delta_dir is None:
            raise ValueError("the disk transport needs delta_dir")
        if get_encoding(overwrite_encoding).needs_base:
            raise ValueError(f"overwrite_encoding {overwrite_encoding!r} must not be base-relative")
        get_encoding(encoding)
        if group is not None and transport != "disk":
            raise ValueError("multi-rank senders use the disk transport")
        self.engines = {u: EngineState(u, acked=version) for u in engines}
        self.transport, self.encoding, self.overwrite_encoding = transport, encoding, overwrite_encoding
        self.delta_dir = Path(delta_dir) if delta_dir is not None else None
        self.flush_bytes, self.anchor_every, self.keep, self.post_hash = flush_bytes, anchor_every, keep, post_hash
        self.client = EngineClient(api_key, timeout_s=timeout_s, retries=retries)
        self.master_addr, self.collective_timeout_s = master_addr, collective_timeout_s
        self.group = group
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.version = version  # last version sent
        self.snapshot_version = version  # S: every engine acknowledged it; the snapshot holds it
        self._snapshot: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}  # positions sent since S (only while an engine lags)
        self._anchor_next = False
        self._links: dict[str, Any] = {}
        self.model_elements = 0

    # ---- setup ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self.group is None:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def seed(self, named_tensors: NamedTensors) -> None:
        """The snapshot: the engines' weights at `version` (a CPU copy; the only copy kept)."""
        self._snapshot = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in _items(named_tensors)}
        self.model_elements = self._all_sum(sum(t.numel() for t in self._snapshot.values()))

    def seed_from_checkpoint(self, hf_dir: str | Path, names: Iterable[str] | None = None) -> None:
        """Seed from the engines' own HF checkpoint bytes (exact even if the trainer's round trip isn't)."""
        from vllm_delta.wire.checkpoint import Checkpoint

        keep = None if names is None else set(names)
        self.seed((n, t) for n, t in Checkpoint.open(hf_dir).iter_tensors() if keep is None or n in keep)

    def add_engine(self, url: str) -> None:
        """A late-joining (or restarted) engine: it gets a full anchor at the next sync."""
        self.engines[url] = EngineState(url, acked=None, needs_anchor=True)

    def remove_engine(self, url: str) -> None:
        self.engines.pop(url, None)
        link = self._links.pop(url, None)
        if link is not None:
            link.close()

    def request_anchor(self) -> None:
        """Send every engine a full anchor at the next sync."""
        self._anchor_next = True

    # ---- one sync ---------------------------------------------------------------------------
    def sync(self, named_tensors: NamedTensors) -> dict[str, float]:
        """Send the changes since the snapshot to every engine; returns the W&B metrics."""
        if not self._snapshot and self.rank == 0 and self.group is None:
            raise RuntimeError("seed() or seed_from_checkpoint() first")
        start = time.perf_counter()
        plan = self._bcast(self._plan() if self.rank == 0 else None)
        delta_b, anchor_b, sinks = self._builders(plan)
        t_enc = time.perf_counter()
        changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        changed = 0
        seen: set[str] = set()
        for name, t in _items(named_tensors):
            snap = self._snapshot.get(name)
            if snap is None:
                raise KeyError(f"{name!r} is not in the snapshot (seed it first)")
            if name in seen:
                raise ValueError(f"{name!r} given twice")
            seen.add(name)
            cur = t.detach()
            if cur.device.type != "cpu":
                cur = cur.to("cpu")
            cur = cur.contiguous()
            pos = changed_positions(cur, snap)
            changed += pos.numel()
            flat, sflat = cur.view(-1), snap.view(-1)
            send = pos if plan.kind != "catchup" else _union(self._pending.get(name), pos)
            digest = None
            if self.post_hash and (anchor_b is not None or (delta_b is not None and send.numel())):
                digest = tensor_digest(cur)
            if delta_b is not None and send.numel():
                old = sflat[send] if delta_b.encoding.needs_base else None
                delta_b.add(name, send, flat[send], old, shape=tuple(cur.shape), post_hash=digest)
            if anchor_b is not None:
                anchor_b.add(name, torch.arange(flat.numel(), dtype=torch.int64), flat.clone(), None,
                             shape=tuple(cur.shape), post_hash=digest)
            if pos.numel():
                changes[name] = (pos, flat[pos])
        missing = [n for n in self._pending if n not in seen]
        if plan.kind == "catchup" and missing:
            raise ValueError(f"params with unsent changes were not given: {missing[:5]}")
        if anchor_b is not None and len(seen) != len(self._snapshot):
            raise ValueError("an anchor needs every param; some were not given")
        sent = [self._finish(kind, b) for kind, b in sinks]
        encode_s = time.perf_counter() - t_enc
        replies = self._push(plan, sent)
        acked = self._settle(plan, replies, changes)
        metrics = self._metrics(plan, sent, replies, changed, encode_s, time.perf_counter() - start, acked)
        return metrics

    def _plan(self) -> Plan:
        """Ask lagging engines where they are; decide who gets a delta, a catch-up or an anchor."""
        version = self.version + 1
        S = self.snapshot_version
        unknown = [e for e in self.engines.values() if e.acked is None]
        for e in self.engines.values():
            e.skipped = False
        if unknown:
            for url, r in self.client.status([e.url for e in unknown]).items():
                e = self.engines[url]
                if not r.ok:
                    e.skipped, e.last_status, e.last_error = True, r.status, r.error
                    continue
                v = r.body.get("version")
                if not r.body.get("healthy") or v is None:
                    e.skipped, e.last_error = True, {"type": "Unhealthy", "message": str(r.body.get("dirty_reasons"))}
                elif not e.needs_anchor and S <= v <= self.version:
                    e.acked = v
                else:
                    e.needs_anchor = True
                    version = max(version, v + 1)  # an engine ahead of us accepts only later versions
        live = [e for e in self.engines.values() if not e.skipped]
        anchor_all = self._anchor_next or bool(self.anchor_every and version % self.anchor_every == 0)
        anchors = [e.url for e in live if anchor_all or e.needs_anchor]
        deltas = [e.url for e in live if e.url not in anchors]
        if all(self.engines[u].acked == S for u in deltas):
            kind, enc = "delta", self.encoding
        else:
            kind, enc = "catchup", self.overwrite_encoding
        base = S if get_encoding(enc).needs_base else None
        return Plan(version, kind if deltas else "", enc, base, deltas, anchors)

    def _builders(self, plan: Plan):
        sinks: list[tuple[str, FlushBuilder]] = []
        delta_b = anchor_b = None
        if plan.delta_urls:
            delta_b = self._builder(plan.kind, plan.version, plan.base_version, plan.encoding)
            sinks.append((plan.kind, delta_b))
        if plan.anchor_urls:
            anchor_b = self._builder("anchor", plan.version, None, self.overwrite_encoding)
            sinks.append(("anchor", anchor_b))
        return delta_b, anchor_b, sinks

    def _dir_name(self, kind: str, version: int) -> str:
        return f"v{version:06d}" + ("" if kind in ("delta", "catchup") else f"-{kind}")

    def _builder(self, kind: str, version: int, base: int | None, encoding: str) -> FlushBuilder:
        if self.transport == "disk":
            from vllm_delta.transports.disk import FlushFileWriter, Throttle, prepare_version_dir

            path = self.delta_dir / self._dir_name(kind, version)
            if self.rank == 0:
                prepare_version_dir(path)
            self._barrier()
            throttle = Throttle(self.throttle_bytes_per_s) if self.throttle_bytes_per_s else None
            writer = FlushFileWriter(path, throttle=throttle)
            b = FlushBuilder(writer.emit, version=version, base_version=base, encoding=encoding,
                             flush_bytes=self.flush_bytes, rank=self.rank, model_elements=self.model_elements)
            b.writer, b.path = writer, path
        else:
            buffers: list[tuple[str, bytes]] = []
            b = FlushBuilder(lambda name, enc: buffers.append((name, enc.data)), version=version, base_version=base,
                             encoding=encoding, flush_bytes=self.flush_bytes, model_elements=self.model_elements)
            b.buffers, b.path = buffers, None
        return b

    def _finish(self, kind: str, b: FlushBuilder) -> SentDelta:
        manifest = b.manifest()
        if self.transport != "disk":
            return SentDelta(kind, manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes, buffers=b.buffers)
        from vllm_delta.transports.disk import seal
        from vllm_delta.wire import merge_manifests

        b.writer.close()  # every flush of this rank is on disk
        parts = self._gather((manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes))
        if self.rank != 0:
            return SentDelta(kind, manifest, len(b.files), b.wire_bytes, b.pre_compress_bytes, location=str(b.path))
        merged = merge_manifests([p[0] for p in parts]) if len(parts) > 1 else manifest
        seal(b.path, merged)
        return SentDelta(kind, merged, len(b.files), sum(p[2] for p in parts), sum(p[3] for p in parts),
                         location=str(b.path))

    def _push(self, plan: Plan, sent: list[SentDelta]) -> dict[str, Reply]:
        replies: dict[str, Reply] = {}
        if self.rank == 0:
            by_kind = {s.kind: s for s in sent}
            targets = {u: by_kind[plan.kind] for u in plan.delta_urls}
            targets.update({u: by_kind["anchor"] for u in plan.anchor_urls})
            if targets:
                replies = (self._push_disk(plan, targets) if self.transport == "disk"
                           else self._push_collective(plan, targets))
            if not self.keep and self.transport == "disk":
                from vllm_delta.transports.disk import remove_version_dir

                for s in sent:
                    remove_version_dir(Path(s.location))
        return self._bcast(replies)

    def _body(self, plan: Plan, s: SentDelta) -> dict[str, Any]:
        return {"version": plan.version, "base_version": s.manifest.base_version}

    def _push_disk(self, plan: Plan, targets: dict[str, SentDelta]) -> dict[str, Reply]:
        bodies = {u: {"path": Path(s.location).name, **self._body(plan, s)} for u, s in targets.items()}
        return self.client.update(bodies)

    def _push_collective(self, plan: Plan, targets: dict[str, SentDelta]) -> dict[str, Reply]:
        import threading

        from vllm_delta.transports.collective import CollectiveLink

        replies: dict[str, Reply] = {}
        ready: dict[str, SentDelta] = {}
        for u, s in targets.items():
            link = self._links.get(u)
            if link is None or link.group is None:
                link = self._links[u] = CollectiveLink(u, self.client, backend=self.transport,
                                                       master_addr=self.master_addr,
                                                       timeout_s=self.collective_timeout_s)
                try:
                    link.connect()
                except Exception as exc:  # this engine misses this version; the next sync retries
                    replies[u] = Reply(u, 0, {"error": {"type": "CollectiveInitError", "message": str(exc)}})
                    continue
            ready[u] = s
        bodies = {u: {"transport": "collective", "manifest": s.manifest.model_dump(mode="json"),
                      **self._body(plan, s)} for u, s in ready.items()}
        out: dict[str, Reply] = {}
        t = threading.Thread(target=lambda: out.update(self.client.update(bodies)))
        t.start()
        for u, s in ready.items():
            try:
                self._links[u].send([data for _, data in s.buffers])
            except Exception as exc:
                logger.warning("delta sender: broadcast to %s failed: %s", u, exc)
        t.join()
        replies.update(out)
        return replies

    def _settle(self, plan: Plan, replies: dict[str, Reply], changes) -> bool:
        """Record acks; advance the snapshot only if every engine now holds `plan.version`."""
        for url, r in replies.items():
            e = self.engines.get(url)
            if e is None:
                continue
            e.last_status = r.status
            if r.ok and r.body.get("version") == plan.version:
                e.acked, e.needs_anchor, e.last_error = plan.version, False, None
            else:
                e.acked, e.last_error = None, r.error  # unknown: ask its status before the next sync
                if self.transport != "disk" and url in self._links:
                    self._links[url].close()  # rebuild the group next time
                logger.warning("delta sender: %s did not apply version %d (%s): %s", url, plan.version, r.status,
                               r.error)
        self.version = plan.version
        if plan.anchor_urls and all(u in plan.anchor_urls for u in self.engines):
            self._anchor_next = False
        all_acked = all(e.acked == plan.version for e in self.engines.values())
        if all_acked:
            for name, (pos, vals) in changes.items():
                self._snapshot[name].view(-1)[pos] = vals
            self._pending.clear()
            self.snapshot_version = plan.version
            self._anchor_next = False
        else:
            for name, (pos, _) in changes.items():
                self._pending[name] = _union(self._pending.get(name), pos)
        return all_acked

    def _metrics(self, plan: Plan, sent: list[SentDelta], replies: dict[str, Reply], changed: int, encode_s: float,
                 total_s: float, acked: bool) -> dict[str, float]:
        changed = self._all_sum(changed)
        wire = sum(s.wire_bytes for s in sent if self.rank == 0 or self.group is None)
        pre = sum(s.pre_compress_bytes for s in sent if self.rank == 0 or self.group is None)
        if self.transport != "disk":  # a broadcast moves the bytes once per engine
            per = {s.kind: s.wire_bytes for s in sent}
            wire = sum(per.get(plan.kind, 0) for _ in plan.delta_urls) + sum(per.get("anchor", 0)
                                                                             for _ in plan.anchor_urls)
        ok = [r.body for r in replies.values() if r.ok]
        return {
            "perf/update_weights_density": changed / max(1, self.model_elements),
            "perf/update_weights_wire_bytes": float(wire),
            "perf/update_weights_disk_bytes_pre_compress": float(pre),
            "perf/update_weights_disk_bytes_post_compress": float(sum(s.wire_bytes for s in sent)),
            "perf/update_weights_compression_ratio": pre / max(1, sum(s.wire_bytes for s in sent)),
            "perf/update_weights_time": total_s,
            "perf/delta_encode_time": encode_s,
            "perf/update_weights_flushes_per_rank": float(max((s.flushes for s in sent), default=0)),
            "perf/update_weights_engine_pause_time": max((b.get("pause_s", 0.0) for b in ok), default=0.0),
            "perf/update_weights_engine_apply_time": max((b.get("apply_s", 0.0) for b in ok), default=0.0),
            "perf/update_weights_engine_decode_time": max((b.get("decode_s", 0.0) for b in ok), default=0.0),
            "sender/version": float(plan.version),
            "sender/snapshot_version": float(self.snapshot_version),
            "sender/changed_elements": float(changed),
            "sender/engines_acked": float(sum(r.ok for r in replies.values())),
            "sender/engines_failed": float(len(self.engines) - sum(
                e.acked == plan.version for e in self.engines.values())),
            "sender/anchors": float(len(plan.anchor_urls)),
            "sender/catchup": float(plan.kind == "catchup"),
            "sender/all_acked": float(acked),
        }

    # ---- multi-rank plumbing (no-ops for one rank) --------------------------------------------
    def _bcast(self, obj):
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out if self.rank == 0 else []

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _all_sum(self, n: int) -> int:
        if self.group is None:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t[0])
