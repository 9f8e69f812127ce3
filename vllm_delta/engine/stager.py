"""Staging one sync: decoded changes located, digested and staged, whatever carried the bytes.

Decoded tensors are gathered into batches of about `BATCH_BYTES`, each located and digested with a
constant number of ops per destination (batched.py; a `DeltaBatch` whole where all its tensors are
batched). A tensor this rank may count twice is masked alone; one the probe could not map is staged
by replaying its loader (fallback.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, repeat
from operator import attrgetter, is_not, itemgetter
from time import perf_counter
from typing import NamedTuple

import torch

from vllm_delta.engine.batched import Known, Located, Piece, cat, compact, locate, on_device
from vllm_delta.engine.digests import Lattice, contains, lattice
from vllm_delta.engine.fallback import Shadows
from vllm_delta.engine.routing import BATCH, FALLBACK, GroupKey, Plan, Routing
from vllm_delta.engine.staging import (
    Chunk,
    Named,
    StagedUpdate,
    Staging,
    Sums,
    check_resolvable,
    expected_digests,
    flat_storage,
    host_values,
    index_dtype,
    stage_sums,
)
from vllm_delta.engine.trace import PhaseTimes
from vllm_delta.wire import Manifest, ParamDelta, get_encoding
from vllm_delta.wire.batch_device import HOST, Decoder
from vllm_delta.wire.deltas import DeltaBatch

# Decoded tensors are located and staged together once they hold this many bytes (engine/batched.py).
BATCH_BYTES = 64 << 20

_PRE, _POST = attrgetter("pre_digest"), attrgetter("post_digest")
_NEITHER = (False, False)  # a tensor with no digest to sum


class _Planned(NamedTuple):
    """A decoded batch the stager takes whole, with its plan."""

    item: DeltaBatch
    plan: Plan


class Stager:
    """One sync's staging: fed decoded items (`take`), then `finish`ed into a `StagedUpdate` (after the
    device decoder's checks are verified)."""

    def __init__(
        self,
        routing: Routing,
        shadows: Shadows,
        manifest: Manifest,
        *,
        max_staged_bytes: int,
        decoder: Decoder = HOST,
        times: PhaseTimes | None = None,
    ) -> None:
        self.routing, self.shadows, self.manifest, self.decoder = routing, shadows, manifest, decoder
        self.entries = dict(
            zip(map(attrgetter("name"), manifest.params), manifest.params)
        )  # no Python line a tensor
        self.staging = Staging(max_staged_bytes)
        self.sums = Sums()
        self.times = times if times is not None else PhaseTimes()
        self.fallback: list[str] = []
        self.total = 0
        self.blocks = [0, 0]
        self.anchor = self._is_anchor()
        self._batch: list[ParamDelta | _Planned] = []
        self._held = 0  # bytes in `_batch`
        self._there = decoder.decoded
        routing.new_sync()

    def _is_anchor(self) -> bool:
        """An overwrite of every element of every checkpoint tensor: repairs whatever a fault left."""
        manifest = self.manifest
        if not get_encoding(manifest.encoding).idempotent:
            return False
        listed = {p.name: p.changed for p in manifest.params}
        return all(
            listed.get(name) == torch.Size(shape).numel()
            for name, (shape, _) in self.routing.checkpoint.items()
        )

    def take(self, item: ParamDelta | DeltaBatch) -> None:
        """Stage one decoded item: a batch whole where its plan allows, else a tensor at a time."""
        if type(item) is not DeltaBatch:
            self.total += item.total
            self._one(item)
            return
        plan = self._take_whole(item)
        if plan is None:
            for delta in item.deltas():
                self.total += delta.total
                self._one(delta)
            return
        self.total += item.total
        self.blocks[0] += item.blocks[0]
        self.blocks[1] += item.blocks[1]
        self._hold(_Planned(item, plan), item.nbytes)

    def _hold(self, item: ParamDelta | _Planned, nbytes: int) -> None:
        self._batch.append(item)
        self._held += nbytes
        if self._held >= BATCH_BYTES:
            self.flush()

    def finish(self, *, version: int, replay: bool, start: float) -> StagedUpdate:
        self.flush()
        self.decoder.verify()
        with self.times.phase("digest"):
            digests = self.sums.hex()
        manifest, params = self.manifest, self.manifest.params
        names = list(map(attrgetter("name"), params))
        staging = self.staging
        return StagedUpdate(
            version=version,
            writes=staging.writes,
            fallback=self.fallback,
            total_changed=self.total,
            changed=staging.changed,
            bytes_read=sum(f.bytes for f in manifest.files),
            decode_s=perf_counter() - start,
            replay=replay,
            max_staged_bytes=staging.bound,
            staged_bytes=staging.nbytes,
            digests=digests,
            expected=expected_digests(names, list(zip(map(_PRE, params), map(_POST, params)))),
            after=dict(
                zip(names, zip(map(attrgetter("digest"), params), map(attrgetter("post_hash"), params)))
            ),
            blocks=(self.blocks[0], self.blocks[1]),
            anchor=self.anchor,
            times=self.times,
        )

    def _take_whole(self, item: DeltaBatch) -> Plan | None:
        """A decoded batch's plan, its wanted digests noted, when all its tensors are batched and decoded
        on the host; else None (nothing noted)."""
        names = item.names
        plan = self.routing.plan(item)
        if plan is None or (self._there and not self._there.isdisjoint(names)):
            return None
        listed = list(map(self.entries.__getitem__, names))
        pres, posts = list(map(_PRE, listed)), list(map(_POST, listed))
        for i in plan.odd:
            if pres[i] is not None:
                self._check_pre_digest(names[i], item.dtypes[i])
        flags = list(zip(map(is_not, pres, repeat(None)), map(is_not, posts, repeat(None))))
        self.sums.names.update(
            zip(names, flags)
            if _NEITHER not in flags
            else [(n, f) for n, f in zip(names, flags) if f != _NEITHER]
        )
        return plan

    def _one(self, delta: ParamDelta) -> None:
        """One decoded tensor: replayed, masked, or held in the batch (staged once it holds `BATCH_BYTES`)."""
        name = delta.name
        decoded_blocks, indexed = delta.blocks
        self.blocks[0] += decoded_blocks
        self.blocks[1] += indexed
        entry = self.entries[name]
        want = (entry.pre_digest is not None, entry.post_digest is not None)
        if want[0] or want[1]:
            self.sums.names[name] = want
        route = self.routing.routes()[name]
        if want[0] and route.kind != FALLBACK and not route.landed.same:
            self._check_pre_digest(name, delta.dtype)
        if route.kind == FALLBACK:
            self.fallback.append(name)
            self.shadows.stage(delta, self.staging, self.sums, want, self.anchor)
        elif route.kind == BATCH:
            self._hold(delta, delta.positions.nbytes + delta.values.nbytes)
        else:
            self._masked(delta)

    def _check_pre_digest(self, name: str, dtype: torch.dtype) -> None:
        """A pre_digest is summed on served values cast back: refused where a segment's dtype cannot be."""
        for seg in self.routing.placements[name].segments:
            served = self.routing.targets[seg.target].dtype
            check_resolvable(seg.target, served, Named(name, dtype), "its pre_digest", "checked")

    def flush(self) -> None:
        """Locate, digest and stage the held batch: a constant number of ops per destination (and per
        kind of decode: on the device, or on the host, as the decoder says)."""
        batch, self._batch, self._held = self._batch, [], 0
        if not batch:
            return
        started = perf_counter()
        routing, there = self.routing, self._there
        # Per destination, dtype and decode: its pieces, and the tensors their slots index.
        groups: dict[GroupKey, tuple[list[Piece], list[str]]] = {}
        # A group a decoded batch feeds: its entries as runs (positions, values, entries a piece).
        runs: dict[GroupKey, list[tuple[torch.Tensor, torch.Tensor, list[int]]]] = {}
        routes = routing.routes()
        known: dict[GroupKey, Known | None] = {}  # a group one plan alone gives
        for delta in batch:
            if type(delta) is _Planned:  # grouped as its plan says (on the host: `take` takes no other whole)
                delta.plan.add(delta.item, groups, runs, known)
                continue
            name, positions, values, needs_base = delta.name, delta.positions, delta.values, delta.needs_base
            landed = routes[name].landed
            kind = (delta.dtype, needs_base, name in there)
            for seg, landing in landed.landings:
                if needs_base and not landed.same:
                    check_resolvable(seg.target, routing.targets[seg.target].dtype, delta)
                key = (seg.target, *kind)
                group = groups.get(key)
                if group is None:  # not setdefault: its two new lists a piece would be garbage nearly always
                    group = groups[key] = ([], [])
                pieces, names = group
                if not names or names[-1] != name:
                    names.append(name)
                pieces.append(Piece(len(names) - 1, positions, values, seg, landed.numel, landing))
                known[key] = None
                if key in runs:
                    runs[key].append((positions, values, [positions.numel()]))
        located_all = []
        for key, (pieces, _) in groups.items():
            target, on_there = key[0], key[3]
            device = routing.targets[target].device  # its flat storage's: no view made for it
            got = runs.get(key)
            joined = (
                None
                if got is None
                else (
                    cat([r[0] for r in got]),
                    cat([r[1] for r in got]),
                    list(chain.from_iterable(map(itemgetter(2), got))),
                )
            )
            # Off the CPU, located on the device (only owned entries cross), compacted below.
            located_all.append(
                locate(
                    pieces,
                    device if on_device(device) else None,
                    defer=True,
                    there=on_there,
                    entries=joined,
                    known=known.get(key),
                )
            )
        deferred = [i for i, loc in enumerate(located_all) if loc.keep is not None]
        # How many entries each keeps: one device-to-host copy per device (on meta, every entry).
        counts = host_values([located_all[i].keep.sum() for i in deferred])
        for i, n in zip(deferred, counts):
            located_all[i] = compact(located_all[i], located_all[i].keep.numel() if n is None else n)
        self.times.add("locate", perf_counter() - started)
        for ((target, dtype, needs_base, _), (_, names)), located in zip(groups.items(), located_all):
            self._stage_located(target, dtype, needs_base, names, located)

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
        noted = list(map(self.sums.names.get, names))  # what `_take_whole`/`_one` noted of each tensor
        if None in noted:  # a tensor without digests, or a batch staged other than by `take`
            noted = [
                (self.entries[n].pre_digest is not None, self.entries[n].post_digest is not None)
                for n in names
            ]
        pre, post = zip(*noted)
        canon = self.routing.targets[target]
        flat = flat_storage(canon)
        device = flat.device
        if not located.offsets.numel():
            return
        located.offsets = self.routing.permuted(target, located.offsets)
        offsets = located.offsets.to(index_dtype(flat)).to(device, non_blocking=True)
        values = located.values.to(device, non_blocking=True)
        if any(pre) or any(post):
            started = perf_counter()
            positions = located.positions.to(device, non_blocking=True)
            slots = (
                located.slots
                if isinstance(located.slots, int)
                else located.slots.to(device, non_blocking=True)
            )
            summed = (offsets, positions, values)
            if counted is not None:  # one tensor (slot 0) whose entries may be counted elsewhere
                keep = torch.nonzero(counted).squeeze(1).to(device)
                summed = tuple(t.index_select(0, keep) for t in summed)
            pre_sums, post_sums = stage_sums(
                flat, *summed, slots, len(names), dtype, needs_base, any(pre), any(post)
            )
            if any(pre):
                self.sums.add_rows(names, 0, pre, pre_sums)
            if any(post):
                self.sums.add_rows(names, 1, post, post_sums)
            self.times.add("digest", perf_counter() - started)
        self.staging.add(
            target,
            Chunk(offsets, values if needs_base else values.to(canon.dtype), dtype if needs_base else None),
        )

    def _masked(self, delta: ParamDelta) -> None:
        """A tensor whose elements this rank may count twice: located a segment at a time, its digests
        summed over the elements no earlier segment and no lower rank holds (as `whole_partial`'s)."""
        routing, name = self.routing, delta.name
        landed = routing.routes()[name].landed
        earlier: list[Lattice] = []
        for seg, landing in landed.landings:
            started = perf_counter()
            located = locate([Piece(0, delta.positions, delta.values, seg, landed.numel, landing)])
            counted = routing.ownership.counted(name, located.positions)
            for lat in earlier:  # an element this rank holds twice counts once
                counted &= ~contains(lat, located.positions)
            earlier.append(lattice(seg))
            self.times.add("locate", perf_counter() - started)
            if delta.needs_base and located.positions.numel():
                check_resolvable(seg.target, routing.targets[seg.target].dtype, delta)
            self._stage_located(seg.target, delta.dtype, delta.needs_base, [name], located, counted)


def stage_all(stager: Stager, deltas: Iterable[ParamDelta | DeltaBatch]) -> None:
    """Feed `deltas` to the stager, timing the waits for the next decoded item as `decode` (the reader
    decodes ahead on its own threads)."""
    times = stager.times
    it = iter(deltas)
    while True:
        started = perf_counter()
        item = next(it, None)
        times.add("decode", perf_counter() - started)
        if item is None:
            return
        stager.take(item)
