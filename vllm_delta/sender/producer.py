"""The scan: diff each shard against its snapshot where it lives, gather the changes, digest them,
and stage only O(changed) bytes on the host.

Why here and not in the encoder: on a GPU trainer the diff, the gather of changed values and the
additive digest are device kernels over data already there; copying every parameter to the host
to compare it (what the first sender did) costs a full device-to-host copy per sync. Only the
changed positions and values cross the bus, through pinned buffers on a side stream, so the copy
of one tensor's changes overlaps the scan of the next.

The snapshot holds the values every engine acknowledged (version S), per shard:
- `snapshot="device"`: a copy beside the parameter (fastest; one parameter's worth of memory);
- `snapshot="host"`: a pinned host copy, streamed to the device in chunks for the compare;
- `"auto"`: the device when the parameters fit twice in its free memory, else the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from vllm_delta.diff import changed_positions
from vllm_delta.sender.shards import Shard
from vllm_delta.wire import additive, tensor_digest

SNAPSHOT_PLACES = ("auto", "device", "host")
# Host-snapshot compares stream this many elements at a time to the device.
STREAM_ELEMENTS = 1 << 24


@dataclass(eq=False)
class Entry:
    """One shard's changes, staged for encoding. Positions are HF flat positions, sorted."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    changed: int  # positions that differ from the snapshot (the rest of `positions` is catch-up)
    positions: torch.Tensor
    new_values: torch.Tensor
    old_values: torch.Tensor | None  # snapshot values there (base-relative deltas only)
    digests: dict[str, torch.Tensor]  # additive digests: "digest" (whole, after), "pre_digest", "post_digest"
    post_hash: str | None = None  # xxh3 of the whole tensor (one writer, host tensors only)
    anchor_positions: torch.Tensor | None = None
    anchor_values: torch.Tensor | None = None


@dataclass(eq=False)
class _Advance:
    """What moves the snapshot to the captured version once every engine acknowledged it."""

    local: torch.Tensor  # changed local positions (on the device)
    values: torch.Tensor  # their new values (on the device)
    digest: torch.Tensor  # the shard's additive digest after the change (on the device)


@dataclass(eq=False)
class Capture:
    """Everything a publish needs, detached from the live weights."""

    entries: list[Entry] = field(default_factory=list)
    advance: dict[str, _Advance] = field(default_factory=dict)
    changed: int = 0
    scan_s: float = 0.0
    stage_s: float = 0.0


@dataclass(eq=False)
class _State:
    placement: tuple  # Shard.describe() as seeded; the tensor itself is not kept
    snapshot: torch.Tensor  # flat
    digest: torch.Tensor  # additive digest of the snapshot's elements, int64[2] on the device
    pending: torch.Tensor | None = None  # local positions sent since S while an engine lags


class Producer:
    """Per rank: snapshots, the diff, and the staged changes of every shard this rank holds."""

    def __init__(self, *, snapshot: str = "auto", post_hash: bool | None = None,
                 staging: str | torch.device = "cpu") -> None:
        if snapshot not in SNAPSHOT_PLACES:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_PLACES}, not {snapshot!r}")
        self.snapshot_place, self.post_hash = snapshot, post_hash
        self.staging = torch.device(staging)
        self._states: dict[str, _State] = {}
        self._copy_streams: dict[torch.device, object] = {}

    # ---- seeding -----------------------------------------------------------------------------
    def seed(self, shards: Iterable[Shard]) -> None:
        shards = list(shards)
        names = [s.name for s in shards]
        if len(set(names)) != len(names):
            raise ValueError("a param was given twice")
        place = self._choose_place(shards)
        self._states = {}
        for s in shards:
            flat = s.tensor.detach().reshape(-1)
            if place == "host" and flat.device.type != "cpu":
                snap = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.device.type == "cuda")
                snap.copy_(flat)
            else:
                snap = flat.clone()
            digest = additive.partial_sum(s.global_index(), flat) if not s.is_whole else additive.tensor_sum(flat)
            self._states[s.name] = _State(s.describe(), snap, digest)
        self.place = place

    def _choose_place(self, shards: list[Shard]) -> str:
        if self.snapshot_place != "auto":
            return self.snapshot_place
        devices = {s.tensor.device for s in shards}
        if not any(d.type == "cuda" for d in devices):
            return "device"  # on the host (or meta) the two places are the same memory
        need = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
        free = min(torch.cuda.mem_get_info(d)[0] for d in devices if d.type == "cuda")
        return "device" if 2 * need <= free else "host"

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
        return self._states[name].snapshot

    def pending_names(self) -> list[str]:
        return [n for n, st in self._states.items() if st.pending is not None]

    def pending_elements(self) -> int:
        """Positions waiting in a catch-up (sent since S while some engine lags)."""
        return sum(st.pending.numel() for st in self._states.values() if st.pending is not None)

    # ---- one scan ------------------------------------------------------------------------------
    def scan(self, shards: Iterable[Shard], *, kind: str, anchor: bool) -> Capture:
        """Diff every shard; stage what a `kind` delta ("delta", "catchup", "") and, with `anchor`,
        a full anchor need. Returns once the weights may change again."""
        cap = Capture()
        start = time.perf_counter()
        seen: set[str] = set()
        for s in shards:
            st = self._states.get(s.name)
            if st is None:
                raise KeyError(f"{s.name!r} is not in the snapshot (seed it first)")
            if s.name in seen:
                raise ValueError(f"{s.name!r} given twice")
            if s.describe() != st.placement:
                raise ValueError(f"{s.name!r}: the shard's placement differs from the seeded one")
            seen.add(s.name)
            cap.entries.append(self._scan_one(s, st, kind, anchor, cap))
        if kind == "catchup" and (missing := [n for n in self.pending_names() if n not in seen]):
            raise ValueError(f"params with unsent changes were not given: {missing[:5]}")
        if anchor and len(seen) != len(self._states):
            raise ValueError("an anchor needs every param; some were not given")
        cap.scan_s = time.perf_counter() - start
        t = time.perf_counter()
        self._wait_staged()
        cap.stage_s = time.perf_counter() - t
        return cap

    def _scan_one(self, s: Shard, st: _State, kind: str, anchor: bool, cap: Capture) -> Entry:
        cur = s.tensor.detach().reshape(-1)
        pos, old = self._diff(cur, st.snapshot)
        new = cur.index_select(0, pos)
        gpos = s.to_global(pos)
        pre, post = additive.partial_sum(gpos, old), additive.partial_sum(gpos, new)
        digest = st.digest - pre + post
        cap.advance[s.name] = _Advance(pos, new, digest)
        cap.changed += pos.numel()
        digests = {"digest": digest}
        send, gsend, send_new, send_old = pos, gpos, new, old
        if kind == "catchup" and st.pending is not None:
            send = _union(st.pending, pos)
            gsend, send_new, send_old = s.to_global(send), cur.index_select(0, send), None
            post = additive.partial_sum(gsend, send_new)
        if kind == "delta":
            digests["pre_digest"] = pre
        digests["post_digest"] = post
        if not s.is_whole:  # global order differs from local order where spans interleave
            order = torch.argsort(gsend)
            gsend, send_new = gsend[order], send_new[order]
            send_old = send_old[order] if send_old is not None else None
        entry = Entry(s.name, s.full_shape, cur.dtype, pos.numel(), self._stage(gsend), self._stage(send_new),
                      self._stage(send_old) if kind == "delta" else None, digests)
        if self._wants_post_hash(s, cur) and (anchor or (kind and send.numel())):
            entry.post_hash = tensor_digest(cur)
        if anchor:
            gall = s.global_index()
            order = torch.argsort(gall) if not s.is_whole else None
            entry.anchor_positions = self._stage(gall if order is None else gall[order])
            entry.anchor_values = self._stage(cur.clone() if order is None else cur[order])
        return entry

    def _wants_post_hash(self, s: Shard, cur: torch.Tensor) -> bool:
        """xxh3 of a whole tensor needs its bytes on the host: by default only where they are."""
        if not s.is_whole:
            return False
        return self.post_hash if self.post_hash is not None else cur.device.type == "cpu"

    def _diff(self, cur: torch.Tensor, snap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(changed local positions, snapshot values there), both on the parameter's device."""
        if snap.device == cur.device:
            pos = changed_positions(cur, snap)
            return pos, snap.index_select(0, pos)
        pos_parts, old_parts = [], []
        for a in range(0, cur.numel(), STREAM_ELEMENTS):  # host snapshot: stream it in chunks
            chunk = snap[a:a + STREAM_ELEMENTS].to(cur.device, non_blocking=True)
            p = changed_positions(cur[a:a + chunk.numel()], chunk)
            pos_parts.append(p + a)
            old_parts.append(chunk.index_select(0, p))
        if not pos_parts:
            return cur.new_zeros(0, dtype=torch.int64), cur.new_zeros(0)
        return torch.cat(pos_parts), torch.cat(old_parts)

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

    def _wait_staged(self) -> None:
        for stream in self._copy_streams.values():
            stream.synchronize()

    # ---- after the engines answered ----------------------------------------------------------------
    def advance(self, cap: Capture) -> None:
        """Every engine holds the captured version: the snapshot becomes it."""
        for name, a in cap.advance.items():
            st = self._states[name]
            local = a.local if st.snapshot.device == a.local.device else a.local.to(st.snapshot.device)
            st.snapshot[local] = a.values.to(st.snapshot.device)
            st.digest, st.pending = a.digest, None

    def defer(self, cap: Capture) -> None:
        """Some engine missed the captured version: remember what was sent since S."""
        for name, a in cap.advance.items():
            if a.local.numel():
                st = self._states[name]
                st.pending = a.local if st.pending is None else _union(st.pending, a.local)



def _union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted union of two sets of positions, with ops every device has (no `unique` on meta)."""
    merged = torch.cat([a, b]).sort().values
    keep = torch.ones_like(merged, dtype=torch.bool)
    keep[1:] = merged[1:] != merged[:-1]
    return merged[keep]
