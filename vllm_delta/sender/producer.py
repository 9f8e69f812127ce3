"""The scan: diff every bucket against its snapshot (version S, every engine acknowledged it) where that
lives, gather and digest the changes, and stage only O(changed) bytes on the host. The snapshot sits on
the "device" (fastest) or the "host" (pinned); "auto" takes the device where it fits (`place_snapshot`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch

import vllm_delta.sender.bucket_scan as bucket_scan
from vllm_delta.sender.capture import Anchor, Bucket, BucketAdvance, Capture, Entry, ShardState
from vllm_delta.sender.shards import Shard, shifted, strided_view
from vllm_delta.wire import additive, tensor_digest

SNAPSHOT_PLACES = ("auto", "device", "host")
# "auto": registration comes before the first step, so Adam's two fp32 moments (8 B per param; not
# DP-sharded: the worst case) do not exist yet; activations and fragmentation get a margin.
OPTIMIZER_BYTES_PER_PARAM = 8
MARGIN_FRACTION = 0.15

logger = logging.getLogger(__name__)


class Producer:
    """Per rank: snapshots, the diff, and the staged changes of every shard this rank holds."""

    def __init__(
        self, *, snapshot: str = "auto", post_hash: bool = False, staging: str | torch.device = "cpu"
    ) -> None:
        if snapshot not in SNAPSHOT_PLACES:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_PLACES}, not {snapshot!r}")
        self.snapshot_place, self.post_hash = snapshot, post_hash
        self.staging = torch.device(staging)
        self._states: dict[str, ShardState] = {}
        self._buckets: dict[tuple, Bucket] = {}  # by layout key
        self._copy_streams: dict[torch.device, object] = {}

    def seed(self, shards: Iterable[Shard]) -> None:
        shards = list(shards)
        if len({s.name for s in shards}) != len(shards):
            raise ValueError("a param was given twice")
        place, why = choose_place(self.snapshot_place, shards)
        logger.info("vllm-delta snapshot on the %s: %s", place, why)
        self._states, self._buckets = {}, {}
        for s in shards:
            flat = s.tensor.detach().reshape(-1)
            if place == "host" and flat.device.type != "cpu":
                snap = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
                snap.copy_(flat)
            else:
                snap = flat.clone()
            digest = additive.tensor_sum(flat) if s.is_whole else additive.partial_sum(s.global_index(), flat)
            self._states[s.name] = ShardState(s.describe(), snap, digest)

    @property
    def names(self) -> list[str]:
        return list(self._states)

    @property
    def elements(self) -> int:
        return sum(s.snapshot.numel() for s in self._states.values())

    def placements(self) -> list[tuple]:
        return [st.placement for st in self._states.values()]

    def snapshot_of(self, name: str) -> torch.Tensor:
        """The snapshot's flat local values (read-only use: tests and seed checks)."""
        return self._states[name].snapshot.reshape(-1)

    def pending_names(self) -> list[str]:
        names = [n for n, st in self._states.items() if st.pending is not None]
        for b in self._buckets.values():
            if b.pending is not None and b.pending.device.type == "meta":
                names += b.layout.names  # meta has no values: every member
            elif b.pending is not None:  # the members with a position in the catch-up
                tables = tuple(t.to(b.pending.device) for t in b.layout.tables)
                counts = bucket_scan.count(tables, len(b.layout.names), b.pending).tolist()
                names += [n for n, c in zip(b.layout.names, counts) if c]
        return names

    def pending_elements(self) -> int:
        """Positions waiting in a catch-up (sent since S while some engine lags)."""
        pending = [st.pending for st in self._states.values()] + [b.pending for b in self._buckets.values()]
        return sum(p.numel() for p in pending if p is not None)

    def scan(self, shards: Iterable[Shard], *, kind: str, anchor: bool) -> Capture:
        """Diff every shard; stage what a `kind` delta ("delta", "catchup", "") and, with `anchor`, a full
        anchor need: a bounded number of ops per bucket, then one host transfer of every bucket's digests
        and counts. Returns once the weights may change again."""
        cap = Capture()
        start = time.perf_counter()
        shards = list(shards)
        by_name: dict[str, Shard] = {}
        for s in shards:
            if s.name not in self._states:
                raise KeyError(f"{s.name!r} is not in the snapshot (seed it first)")
            if s.name in by_name:
                raise ValueError(f"{s.name!r} given twice")
            if s.describe() != self._states[s.name].placement:
                raise ValueError(f"{s.name!r}: the shard's placement differs from the seeded one")
            by_name[s.name] = s
        # before any bucket is re-formed around the shards given: a refusal changes nothing
        if kind == "catchup" and (missing := [n for n in self.pending_names() if n not in by_name]):
            raise ValueError(f"params with unsent changes were not given: {missing[:5]}")
        if anchor and len(by_name) != len(self._states):
            raise ValueError("an anchor needs every param; some were not given")
        entries: dict[str, Entry] = {}
        scans, stage = [], self._stage
        for layout in bucket_scan.plan(shards, {k: b.layout for k, b in self._buckets.items()}):
            b = self._bucket(layout)
            res = bucket_scan.scan(layout, b.snapshot, b.digests, b.pending, kind)
            cap.buckets.append(BucketAdvance(b, res.pos, res.new, res.digest))
            cap.changed += res.pos.numel()
            staged = stage(res.hf), stage(res.send_new), stage(res.send_old) if kind == "delta" else None
            scans.append((layout, res.summary, staged))
        if scans:  # every bucket's digests and counts, in one transfer
            summary = torch.cat([sums for _, sums, _ in scans]).to(self.staging)
            rows = summary.view(-1, 2).unbind(0)  # per member: digest, pre and post rows
            values = None if summary.device.type == "meta" else summary.tolist()  # meta has no values
            at = 0
            for layout, _, staged in scans:
                n = len(layout.names)
                if values is not None:
                    changed, sent = values[at + 6 * n : at + 7 * n], values[at + 7 * n : at + 8 * n]
                else:  # meta checks devices, not counts: every change on the first member
                    changed = sent = [staged[0].numel()] + [0] * (n - 1)
                hf, new, old = (
                    (t,) if n == 1 else t.split(sent) if t is not None else [None] * n for t in staged
                )
                for i, name in enumerate(layout.names):
                    s, st = by_name[name], self._states[name]
                    digests = {"digest": rows[at // 2 + i], "post_digest": rows[at // 2 + 2 * n + i]}
                    if kind == "delta":
                        digests["pre_digest"] = rows[at // 2 + n + i]
                    e = entries[name] = Entry(
                        name,
                        s.full_shape,
                        s.tensor.dtype,
                        changed[i],
                        hf[i],
                        new[i],
                        old[i],
                        digests,
                        scanned=True,
                    )
                    if self.post_hash and s.is_whole and (anchor or (kind and sent[i])):
                        e.post_hash = tensor_digest(s.tensor)
                    if anchor:  # nothing per element: the snapshot (untouched until settled) and the changes
                        snap = st.snapshot.reshape(-1)
                        ready = torch.cuda.Event() if snap.device.type == "cuda" else None
                        if ready is not None:
                            ready.record(torch.cuda.current_stream(snap.device))
                        e.anchor = Anchor(st.placement, snap, hf[i], new[i], self.staging, ready)
                at += 8 * n
        cap.entries = [entries[s.name] for s in shards]
        cap.scan_s = time.perf_counter() - start
        t = time.perf_counter()
        for stream in self._copy_streams.values():
            stream.synchronize()
        cap.stage_s = time.perf_counter() - t
        return cap

    def _bucket(self, layout: bucket_scan.Layout) -> Bucket:
        """The bucket's snapshot, built at its layout's first scan: a flat copy of its span holding the
        members' snapshots as views (uncovered elements start live)."""
        b = self._buckets.get(layout.key)
        if b is not None:
            return b
        for old in [o for o in self._buckets.values() if set(o.layout.names) & set(layout.names)]:
            self._unbucket_pending(old)  # a member moved (new storage, other members): its old bucket goes
            del self._buckets[old.layout.key]
        states = [self._states[n] for n in layout.names]
        place = states[0].snapshot.device
        pin = place.type == "cpu" and layout.base.device.type == "cuda"
        snap = torch.empty(layout.base.shape, dtype=layout.base.dtype, device=place, pin_memory=pin)
        snap.copy_(layout.base)
        digests = torch.stack([st.digest for st in states]).to(place)
        for i, (st, runs) in enumerate(zip(states, layout.local_runs)):
            view = strided_view(snap, runs)
            view.copy_(st.snapshot.reshape(view.shape))
            st.snapshot, st.digest = view, digests[i]
        b = self._buckets[layout.key] = Bucket(layout, snap, digests)
        for st, runs in zip(states, layout.local_runs):
            if st.pending is not None:  # a member's catch-up positions, as bucket offsets
                p = shifted(st.pending, runs).to(snap.device)
                b.pending = p if b.pending is None else bucket_scan.union(b.pending, p)
                st.pending = None
        return b

    def _unbucket_pending(self, b: Bucket) -> None:
        """The bucket's catch-up positions back on its members, as local positions."""
        if b.pending is None:
            return
        seg, *_ = bucket_scan.locate(tuple(t.to(b.pending.device) for t in b.layout.tables), b.pending)
        for i, (name, runs) in enumerate(zip(b.layout.names, b.layout.local_runs)):
            mine = b.pending[seg == i]
            if not mine.numel():
                continue
            starts = torch.tensor([a for a, _ in runs], device=mine.device)
            before = torch.tensor([0] + [n for _, n in runs[:-1]], device=mine.device).cumsum(0)
            r = torch.searchsorted(starts, mine, right=True) - 1
            local = mine - starts[r] + before[r]
            st = self._states[name]
            st.pending = local if st.pending is None else bucket_scan.union(st.pending, local)
        b.pending = None

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy (pinned, on a side stream, not yet waited for) of O(changed) device data."""
        if t.device == self.staging:
            return t
        if t.device.type != "cuda":
            return t.to(self.staging)
        stream = self._copy_streams.get(t.device)
        if stream is None:
            stream = self._copy_streams[t.device] = torch.cuda.Stream(device=t.device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)
        return host

    def advance(self, cap: Capture) -> None:
        """Every engine holds the captured version: the snapshot becomes it."""
        for ba in cap.buckets:
            b = ba.bucket
            b.snapshot[ba.pos] = ba.values
            b.digests.copy_(ba.digests)
            b.pending = None

    def defer(self, cap: Capture) -> None:
        """Some engine missed the captured version: remember what was sent since S."""
        for ba in cap.buckets:
            if ba.pos.numel():
                b = ba.bucket
                b.pending = ba.pos if b.pending is None else bucket_scan.union(b.pending, ba.pos)


def choose_place(mode: str, shards: Sequence[Shard]) -> tuple[str, str]:
    """("device" or "host", why) for the snapshot of `shards` under `mode` (one of SNAPSHOT_PLACES)."""
    if mode != "auto":
        return mode, "chosen explicitly"
    devices = {s.tensor.device for s in shards}
    if not any(d.type == "cuda" for d in devices):
        return "device", "the weights are not on a GPU (the two places are the same memory)"
    need = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
    params = sum(s.tensor.numel() for s in shards)
    free, total = (min(x) for x in zip(*(torch.cuda.mem_get_info(d) for d in devices if d.type == "cuda")))
    return place_snapshot(need, params, free, total)


def place_snapshot(snapshot_bytes: int, params: int, free: int, total: int) -> tuple[str, str]:
    """The "auto" rule: the device only if the snapshot, optimizer state and a margin fit its free memory."""
    optimizer = OPTIMIZER_BYTES_PER_PARAM * params
    margin = int(MARGIN_FRACTION * total)
    fits = snapshot_bytes + optimizer + margin <= free
    gib = 1 << 30
    why = (
        f"snapshot {snapshot_bytes / gib:.1f} GiB + optimizer state {optimizer / gib:.1f} GiB + margin "
        f"{margin / gib:.1f} GiB {'<=' if fits else '>'} free {free / gib:.1f} GiB"
    )
    return ("device" if fits else "host"), why
