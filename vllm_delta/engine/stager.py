"""Staging one sync: decoded changes located, digested and staged, whatever carried the bytes.

Decoded tensors are gathered into batches of about `BATCH_BYTES`, each located and digested with a
constant number of ops per destination (batched.py; a `DeltaBatch` whole where all its tensors are
batched). A tensor this rank may count twice is masked alone; one the probe could not map is staged
by replaying its loader (fallback.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, itemgetter
from time import perf_counter

import numpy as np
import torch

from vllm_delta.engine.batched import Group, Located, Piece, cat, compact, locate, on_device
from vllm_delta.engine.digests import Lattice, lattice
from vllm_delta.engine.fallback import Shadows
from vllm_delta.engine.routing import BATCH, FALLBACK, GroupKey, Plan, Routing
from vllm_delta.engine.staging import (
    Chunk,
    StagedUpdate,
    Staging,
    Sums,
    check_resolvable,
    flat_storage,
    host_values,
    index_dtype,
    stage_sums,
)
from vllm_delta.engine.trace import PhaseTimes
from vllm_delta.wire import Manifest, ParamDelta, get_encoding
from vllm_delta.wire.batch_device import HOST, Decoder
from vllm_delta.wire.deltas import DeltaBatch

# Decoded tensors are located and staged together once they hold this many bytes (engine/batched.py); a
# flush holds ~2.5x it in temporaries (64 MiB: 150 MB of a 256 MB peak at 2%, docs/results/apply.md).
BATCH_BYTES = 16 << 20

_PRE, _POST, _NAME = attrgetter("pre_digest"), attrgetter("post_digest"), attrgetter("name")


class Stager:
    """One sync's staging: fed decoded items (`take`), then `finish`ed into a `StagedUpdate` (after the
    device decoder's checks are verified)."""

    def __init__(
        self,
        routing: Routing,
        shadows: Shadows,
        manifest: Manifest,
        max_staged_bytes: int,
        decoder: Decoder = HOST,
        times: PhaseTimes | None = None,
    ) -> None:
        self.routing, self.shadows, self.manifest, self.decoder = routing, shadows, manifest, decoder
        self.entries = dict(zip(map(_NAME, manifest.params), manifest.params))  # no Python line a tensor
        self.staging = Staging(max_staged_bytes)
        self.sums = Sums()
        self.times = times if times is not None else PhaseTimes()
        self.fallback: list[str] = []
        self.total = 0
        self.blocks = [0, 0]
        # An overwrite of every element of every checkpoint tensor: repairs whatever a fault left.
        self.anchor = get_encoding(manifest.encoding).idempotent and all(
            getattr(self.entries.get(name), "changed", None) == torch.Size(shape).numel()
            for name, (shape, _) in routing.checkpoint.items()
        )
        self._batch: list[ParamDelta | tuple[DeltaBatch, Plan]] = []
        self._held = 0  # bytes in `_batch`
        self._there = decoder.decoded
        routing.new_sync()

    def run(self, deltas: Iterable[ParamDelta | DeltaBatch]) -> None:
        """Take every item, timing the waits for the next one as `decode` (the reader decodes ahead)."""
        started = perf_counter()
        for item in deltas:
            self.times.add("decode", perf_counter() - started)
            self.take(item)
            started = perf_counter()
        self.times.add("decode", perf_counter() - started)

    def take(self, item: ParamDelta | DeltaBatch) -> None:
        """Stage one decoded item: a batch whole where its plan allows, else a tensor at a time."""
        plan = None if type(item) is not DeltaBatch else self._take_whole(item)
        if plan is None:
            for delta in [item] if type(item) is not DeltaBatch else item.deltas():
                self.total += delta.total
                self._one(delta)
            return
        self.total += item.total
        self.blocks[0] += item.blocks[0]
        self.blocks[1] += item.blocks[1]
        self._hold((item, plan), item.nbytes)

    def _hold(self, item: ParamDelta | tuple[DeltaBatch, Plan], nbytes: int) -> None:
        self._batch.append(item)
        self._held += nbytes
        if self._held >= BATCH_BYTES:
            self.flush()

    def finish(self, *, version: int, replay: bool) -> StagedUpdate:
        """The staged update (its `decode_s`, the whole prepare's, the caller's to set)."""
        self.flush()
        self.decoder.verify()
        with self.times.phase("digest"):
            digests = self.sums.hex()
        manifest, params = self.manifest, self.manifest.params
        names = list(map(_NAME, params))
        pairs = list(zip(map(_PRE, params), map(_POST, params)))
        return StagedUpdate(
            version=version,
            writes=self.staging.writes,
            fallback=self.fallback,
            total_changed=self.total,
            changed=self.staging.changed,
            bytes_read=sum(f.bytes for f in manifest.files),
            replay=replay,
            max_staged_bytes=self.staging.bound,
            staged_bytes=self.staging.nbytes,
            digests=digests,
            # Each tensor's (pre, post) digests, where it has either (no loop a tensor).
            expected=dict(compress(zip(names, map(list, pairs)), map((None, None).__ne__, pairs))),
            after=dict(
                zip(names, zip(map(attrgetter("digest"), params), map(attrgetter("post_hash"), params)))
            ),
            blocks=(self.blocks[0], self.blocks[1]),
            anchor=self.anchor,
            times=self.times,
        )

    def _take_whole(self, item: DeltaBatch) -> Plan | None:
        """A decoded batch's plan when all its tensors are batched and decoded on the host, else None."""
        plan = self.routing.plan(item)
        if plan is None or (self._there and not self._there.isdisjoint(item.names)):
            return None
        for i in plan.odd:
            name = item.names[i]
            self._check_served(
                name, item.dtypes[i], item.needs_base, self.entries[name].pre_digest is not None
            )
        return plan

    def _one(self, delta: ParamDelta) -> None:
        """One decoded tensor: replayed, masked, or held in the batch (staged once it holds `BATCH_BYTES`)."""
        name = delta.name
        self.blocks[0] += delta.blocks[0]
        self.blocks[1] += delta.blocks[1]
        entry = self.entries[name]
        want = (entry.pre_digest is not None, entry.post_digest is not None)
        route = self.routing.routes()[name]
        if not route.same:
            self._check_served(name, delta.dtype, delta.needs_base and route.kind == BATCH, want[0])
        if route.kind == FALLBACK:
            self.fallback.append(name)
            self.shadows.stage(delta, self.staging, self.sums, want, self.anchor)
        elif route.kind == BATCH:
            self._hold(delta, delta.positions.nbytes + delta.values.nbytes)
        else:
            self._masked(delta)

    def _check_served(self, name: str, dtype: torch.dtype, needs_base: bool, pre_digest: bool) -> None:
        """A tensor served in another dtype on some segment: its pre_digest (summed on served values cast
        back) and its base-relative steps are refused where a segment's dtype cannot be cast back."""
        for pre in [True] * pre_digest + [False] * needs_base:
            for seg in self.routing.placements[name].segments:
                check_resolvable(
                    seg.target, self.routing.targets[seg.target].dtype, name, dtype, pre_digest=pre
                )

    def flush(self) -> None:
        """Locate, digest and stage the held batch: a constant number of ops per destination (and per
        kind of decode: on the device, or on the host, as the decoder says)."""
        batch, self._batch, self._held = self._batch, [], 0
        if not batch:
            return
        started = perf_counter()
        routing, there, groups, routes = self.routing, self._there, _Groups(), self.routing.routes()
        for delta in batch:
            if type(delta) is tuple:  # on the host: `take` takes no other batch whole
                groups.add_planned(*delta)
                continue
            name, positions, values, route = delta.name, delta.positions, delta.values, routes[delta.name]
            kind = (delta.dtype, delta.needs_base, name in there)
            for seg, landing in route.landings:
                key = (seg.target, *kind)
                groups.join(key).add(name, seg, route.numel, landing)
                groups.runs[key].append((positions, values, [positions.numel()]))
        located_all = []
        for key, group in groups.items():
            device = routing.targets[key[0]].device  # its flat storage's: no view made for it
            runs = groups.runs[key]  # no Python line an entry's count:
            joined = (
                cat([r[0] for r in runs]),
                cat([r[1] for r in runs]),
                list(chain(*map(itemgetter(2), runs))),
            )
            # Off the CPU, located on the device (only owned entries cross), compacted below.
            where = device if on_device(device) else None
            located_all.append(locate(group, where, defer=True, there=key[3], entries=joined))
        deferred = [i for i, loc in enumerate(located_all) if loc.keep is not None]
        # How many entries each keeps: one device-to-host copy per device (on meta, every entry).
        counts = host_values([located_all[i].keep.sum() for i in deferred])
        for i, n in zip(deferred, counts):
            located_all[i] = compact(located_all[i], located_all[i].keep.numel() if n is None else n)
        self.times.add("locate", perf_counter() - started)
        for ((target, dtype, needs_base, _), group), located in zip(groups.items(), located_all):
            self._stage_located(target, dtype, needs_base, group.names, located)

    def _stage_located(
        self,
        target: str,
        dtype: torch.dtype,
        needs_base: bool,
        names: list[str],
        located: Located,
        counted: torch.Tensor | None = None,
    ) -> None:
        """Digest and stage one destination group's located entries (one chunk); the digests sum only
        the `counted` entries, where given."""
        if not located.offsets.numel():
            return
        listed = list(map(self.entries.__getitem__, names))  # no Python line a tensor
        pre = list(map(is_not, map(_PRE, listed), repeat(None)))
        post = list(map(is_not, map(_POST, listed), repeat(None)))
        canon = self.routing.targets[target]
        flat = flat_storage(canon)
        device = flat.device
        located.offsets = self.routing.permuted(target, located.offsets)
        offsets = located.offsets.to(index_dtype(flat)).to(device, non_blocking=True)
        values = located.values.to(device, non_blocking=True)
        if any(pre) or any(post):
            started = perf_counter()
            slots = located.slots
            summed = (offsets, located.positions.to(device, non_blocking=True), values)
            if not isinstance(slots, int):
                slots = slots.to(device, non_blocking=True)
            if counted is not None:  # one tensor (slot 0) whose entries may be counted elsewhere
                keep = torch.nonzero(counted).squeeze(1).to(device)
                summed = tuple(t.index_select(0, keep) for t in summed)
            sums = stage_sums(flat, *summed, slots, len(names), dtype, needs_base, any(pre), any(post))
            for lane, wanted, lane_sums in zip((0, 1), (pre, post), sums):
                if any(wanted):
                    self.sums.add_rows(names, lane, wanted, lane_sums)
            self.times.add("digest", perf_counter() - started)
        self.staging.add(
            target,
            Chunk(offsets, values if needs_base else values.to(canon.dtype), dtype if needs_base else None),
        )

    def _masked(self, delta: ParamDelta) -> None:
        """A tensor whose elements this rank may count twice: located a segment at a time, its digests
        summed over the elements no earlier segment and no lower rank holds (as `whole_partial`'s)."""
        routing, name = self.routing, delta.name
        route = routing.routes()[name]
        earlier: list[Lattice] = []
        for seg, landing in route.landings:
            started = perf_counter()
            located = locate([Piece(0, delta.positions, delta.values, seg, route.numel, landing)])
            counted = routing.counted(name, located.positions, earlier)
            earlier.append(lattice(seg))
            self.times.add("locate", perf_counter() - started)
            if delta.needs_base and located.positions.numel():
                check_resolvable(seg.target, routing.targets[seg.target].dtype, name, delta.dtype)
            self._stage_located(seg.target, delta.dtype, delta.needs_base, [name], located, counted)


class _Groups(dict[GroupKey, Group]):
    """A flush's groups by (destination, dtype, needs_base, decoded on the device); the entries of those a
    decoded batch feeds, as runs; and those still a plan's own (kept across syncs: copied before joined)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[GroupKey, list[tuple[torch.Tensor, torch.Tensor, list[int]]]] = {}
        self.kept: set[GroupKey] = set()

    def join(self, key: GroupKey) -> Group:
        """The key's group, to add to."""
        group = self.get(key)
        if group is None:
            group, self.runs[key] = Group([], []), []
            self[key] = group
        elif key in self.kept:
            self.kept.discard(key)
            group = self[key] = Group(list(group.names), list(group.pieces))
        return group

    def add_planned(self, item: DeltaBatch, plan: Plan) -> None:
        """A decoded batch's pieces and entries, one gather per group."""
        sizes = np.array(item.sizes, dtype=np.int64)
        length = sizes[plan.order]  # entries of each piece
        end = np.cumsum(length)
        # Each piece's entries, in group order: its param's run of the batch's entries.
        index = torch.from_numpy(
            np.repeat((np.cumsum(sizes) - sizes)[plan.order] - (end - length), length)
            + np.arange(int(end[-1]) if end.size else 0, dtype=np.int64)
        )
        at = np.concatenate(([0], end))[plan.bounds].tolist()
        counts, b = length.tolist(), plan.bounds
        for g, (key, vtype, own) in enumerate(plan.groups):
            sub = index[at[g] : at[g + 1]]
            run = (
                item.positions.index_select(0, sub),
                item.values[vtype].index_select(0, sub),
                counts[b[g] : b[g + 1]],
            )
            if key not in self:
                self[key], self.runs[key] = own, [run]
                self.kept.add(key)
                continue
            group = self.join(key)
            base = len(group.names)
            group.names.extend(own.names)
            group.pieces.extend(
                Piece(base + p.slot, None, None, p.seg, p.numel, p.landing) for p in own.pieces
            )
            self.runs[key].append(run)
