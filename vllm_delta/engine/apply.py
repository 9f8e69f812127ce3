"""Two-phase in-place apply of a delta on one rank: prepare (read, verify, decode, locate, digest),
then commit (scatter into the live parameters).

Why two phases: everything that can fail on bad input (I/O, hashes, bounds, names, shapes,
dtypes, lineage, the additive digests of the changed positions) fails in `prepare`, before any
weight changes and while the engine still serves. `commit` only scatters precomputed (offset,
value) chunks, so the engine is held for the scatter alone and a failure there is an engine
fault, reported with the tensors it may have left half-written, never a silent one.

Device: decoded entries are located a batch of tensors at a time with a constant number of ops
per destination (engine/batched.py): on the host for a CPU destination; otherwise only the owned
positions and values cross, once, and the locate runs on the destination's device. There current
values are read, ULP steps resolved and digests summed in torch integer ops, and the entries are
staged there, so the commit is a handful of
`index_copy_` per destination and no copy. `chunk_bytes` bounds everything an update stages:
past it, prepare refuses (413) before any weight changes. Nothing here needs vLLM except the
fallback loader.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain, compress, count, repeat
from operator import attrgetter, getitem, is_not, itemgetter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from vllm_delta.engine import cpu_weights, derived, loaders, reach, transforms
from vllm_delta.engine.batched import Known, Landing, Piece, compact, locate, on_device, owned_counts
from vllm_delta.engine.cli_args import DEFAULT_CHUNK_BYTES
from vllm_delta.engine.digests import Ownership, contains, lattice, segment_chunks
from vllm_delta.engine.fallback import UnservableLoader, bits, check_servable, differs, replay, same_layout, shadow_target
from vllm_delta.engine.owned import owned_by_tensor
from vllm_delta.engine.placement import PeakRss, Segment, TensorPlacement, build_placement
from vllm_delta.kernels import scatter as scatter_kernel
from vllm_delta.kernels.digest import segment_sums
from vllm_delta.wire import (DeltaDecoder, DeltaInfo, IncompleteDeltaError, Manifest, ParamDelta, VersionError,
                             get_encoding, iter_delta, open_delta, tensor_digest)
from vllm_delta.wire.batch_device import Destinations
from vllm_delta.wire.additive import partial_sum, tensor_sum, to_hex
from vllm_delta.wire.container import paused_gc
from vllm_delta.wire.codecs import ulp_resolve_tensor
from vllm_delta.wire.flush import DeltaBatch
from vllm_delta.wire.errors import DtypeMismatchError, IncompatibleDeltaError, IntegrityError

logger = logging.getLogger(__name__)

Checkpoint = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
# Decoded tensors are located and staged together once they hold this many bytes (engine/batched.py).
BATCH_BYTES = 64 << 20
# Entries the compiled CPU commit writes, then reads back, at a time (`_blocks`): ~1.6 MB of weights at 2%.
CPU_BLOCK = 1 << 14
# How `stage` takes a tensor (DeltaApplier._routes): replayed through its loader, batched, or masked alone.
_FALLBACK, _BATCH, _MASKED = 0, 1, 2


class ApplyFault(Exception):
    """The scatter failed part-way: the weights of `suspect` (live tensor names) may be partly written."""

    def __init__(self, message: str, *, failed_at: str | None, suspect: list[str]) -> None:
        super().__init__(message)
        self.failed_at = failed_at
        self.suspect = suspect


@dataclass
class Chunk:
    """Writes to one destination, staged on its device: one per batch of tensors feeding it.

    `offsets` index the destination's flat storage (int32 where it has < 2^31 elements). `values`
    are new values in the destination's dtype, or, when `base` is set, signed ULP steps to apply
    in dtype `base` to the current values, resolved on the device at commit.
    """

    offsets: torch.Tensor
    values: torch.Tensor
    base: torch.dtype | None = None


@dataclass
class StagedUpdate:
    """Everything `commit` needs, computed in `prepare` without touching a weight."""

    version: int
    writes: dict[str, deque[Chunk]]  # destination -> chunks, consumed (and freed) by the commit
    fallback: list[str]  # tensors staged by replaying their loader (engine/fallback.py)
    total_changed: int
    changed: int  # entries this rank writes
    bytes_read: int
    decode_s: float
    replay: bool
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the bound on everything staged
    staged_bytes: int = 0
    # This rank's counted-once partial sums [pre, post] of the changed positions, and the
    # manifest's expectations, for every param whose manifest entry carries pre/post digests.
    digests: dict[str, list[str | None]] = field(default_factory=dict)
    expected: dict[str, list[str | None]] = field(default_factory=dict)
    # What a later full verify checks: whole-tensor additive digest / xxh3 after this update.
    after: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    anchor: bool = False  # overwrites every element of every checkpoint tensor
    blocks: tuple[int, int] = (0, 0)  # position blocks (decoded, in the delta) of block-indexed flushes

    @property
    def fallback_names(self) -> list[str]:
        return sorted(set(self.fallback))


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of `t`, so storage offsets index it directly."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


def same_device(*tensors: torch.Tensor) -> None:
    """Refuse mixed devices explicitly: some kernels (indexing on meta, CPU indices on CUDA) accept them."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"tensors on different devices: {sorted(str(d) for d in devices)}")


def gather(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    same_device(flat, offsets)
    return flat.index_select(0, offsets)


class DeltaApplier:
    """Applies deltas to one model on one rank, through placements learned once per model."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint,
                 load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None, *,
                 placements: dict[str, TensorPlacement] | None = None, rank: int = 0,
                 read: Callable[[str], torch.Tensor] | None = None) -> None:
        self.model = model
        self.checkpoint = dict(checkpoint)
        # Parameters a post-load step replaced are loaded through their model format (engine/loaders.py).
        self._load_weights = load_weights or loaders.model_format(model)
        self.targets = {name: canon for name, (_, canon) in cpu_weights.canonical_tensors(model).items()}
        # Parameters a post-load step permuted: deltas located in the loaded layout go through these.
        self.offset_maps = transforms.offset_maps(model)
        self._placements = placements
        self.probe_s: float | None = None
        self.probe_peak_bytes: int | None = None
        self.rank = rank
        self.ownership = Ownership()  # until the route hands over the other ranks' coverage
        # Tensors the probe could not map: their checkpoint values (read with `read`), kept to
        # replay their loader exactly (engine/fallback.py), or why that loader is refused.
        self._read = read
        self.shadows: dict[str, torch.Tensor] | None = None
        self.refused: dict[str, str] = {}
        self.coverage: dict[str, object] | None = None  # digests.check_coverage across ranks, at startup
        self._disjoint: dict[str, bool] = {}  # tensor -> its segments here hold disjoint ids
        self._routed: tuple[Ownership, dict[str, tuple[int, tuple | None]]] | None = None  # see _routes
        self._plans: tuple[dict | None, dict, dict] = (None, {}, {})  # routes, last sync's plans, this one's: _plan
        self._landed: dict[str, tuple[int, tuple[tuple[Segment, Landing], ...], bool]] = {}  # see _landings
        self._decode_devices: tuple[Ownership, dict[str, torch.device]] | None = None  # see _owned
        self._owned_ranges: dict[str, list[tuple[int, int]] | None] | None = None  # see owned_ranges
        self._claimed: set[str] | None = None  # the parameters the probe's load_weights said it loaded

    def _storages(self) -> dict[int, str]:
        """Live parameter storages -> their names: what the probe and the fallback replay record into."""
        return {live.untyped_storage().data_ptr(): name
                for name, (live, _) in cpu_weights.canonical_tensors(self.model).items() if live.numel() > 0}

    @property
    def placements(self) -> dict[str, TensorPlacement]:
        if self._placements is None:
            start = time.perf_counter()
            with PeakRss() as peak:
                self._placements = build_placement(self._noting_loaded, self._storages(), self.checkpoint)
            self.probe_s, self.probe_peak_bytes = time.perf_counter() - start, peak.extra
            logger.info("delta updates: placement of %d tensors learned in %.2fs (+%s B peak)",
                        len(self._placements), self.probe_s, peak.extra)
        if self.shadows is None:
            self._plan_fallbacks()
        return self._placements

    def _noting_loaded(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """The model's `load_weights`, noting the parameters it says it loaded (vLLM's models return
        their names; None: the loader says nothing, and every destination is held to the reach check)."""
        loaded = self._load_weights(weights)
        if isinstance(loaded, (set, frozenset, list, tuple)):
            self._claimed = (self._claimed or set()) | {n for n in loaded if isinstance(n, str)}
        return loaded

    def _reach_checked(self, storages: Mapping[int, str]) -> dict[str, torch.Tensor]:
        """The destinations the reach check holds to their size: those the loader said it loaded (all,
        if it said nothing; a parameter it never loads keeps vLLM's default, like fp8's `k_scale`),
        except the parameters a post-load step derived."""
        made = reach.derived_params((t.unit, t.key) for t in derived.discovery(self.model).tensors)
        named = {n: storages.get(t.untyped_storage().data_ptr()) for n, (t, _) in cpu_weights.canonical_tensors(
            self.model).items() if t.numel()}
        wanted = set(storages.values()) if self._claimed is None else {named.get(n) for n in self._claimed} - {None}
        return {n: self.targets[n] for n in wanted if n not in made}

    def _plan_fallbacks(self) -> None:
        """At startup: keep a shadow of every unmapped tensor whose loader replays exactly; refuse the rest."""
        self.shadows, storages, replayed = {}, self._storages(), set()
        for name, placement in self._placements.items():
            if not placement.fallback_reason:
                continue
            if self._read is None:
                self.refused[name] = "no checkpoint to replay its loader from"
                continue
            shadow = self._read(name).to(placement.dtype).contiguous()
            try:
                replayed |= check_servable(self._load_weights, storages, name, shadow, self.targets)
            except UnservableLoader as exc:
                self.refused[name] = f"{placement.fallback_reason}; its loader cannot be replayed exactly: {exc}"
                continue
            except Exception as exc:  # e.g. a quant method's replace_parameter left a loader that now fails
                self.refused[name] = f"{placement.fallback_reason}; its loader fails on replay: {type(exc).__name__}: {exc}"
                continue
            self.shadows[name] = shadow
            self.targets[shadow_target(name)] = shadow
        if not self.refused:  # a refused tensor explains the destinations it leaves unreached
            self.refused.update(reach.unreached(self._placements, self._reach_checked(storages), replayed))
        if self.refused:
            logger.error("delta updates: refused, loaders that cannot be served exactly: %s", self.refused)

    @property
    def probed(self) -> bool:
        return self._placements is not None

    @property
    def fallback_tensors(self) -> dict[str, str]:
        return {n: p.fallback_reason for n, p in self.placements.items() if p.fallback_reason}

    def placement_status(self) -> dict[str, object]:
        """What `/delta_updates/status` shows under `placement` (never triggers the probe)."""
        ready = self.probed
        return {"ready": ready, "probe_s": self.probe_s, "probe_peak_bytes": self.probe_peak_bytes,
                "fallback": self.fallback_tensors if ready else None, "refused": self.refused if ready else None, "coverage": self.coverage,
                "transformed": sorted(transforms.transformed(self.model))}

    # ---- phase 1 -------------------------------------------------------------------------
    def prepare(self, path: str | Path | DeltaInfo, *, version: int, base_version: int | None,
                current_version: int, files: list[str] | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, decode_threads: int | None = None) -> StagedUpdate:
        """Read, verify and decode the delta in a version directory; locate each entry this rank owns.

        Flushes are read and decoded on `decode_threads` threads (default: this thread's torch
        intra-op count; the engine passes worker.decode_threads), ahead of the staging; the garbage
        collector is paused meanwhile (the decoded deltas form no cycles, and two full collections
        over a 44k-tensor update's objects cost ~20 us a tensor). `path` may be the delta already
        opened (the worker opens it for its lineage check): its manifest is then not parsed again.
        """
        start = time.perf_counter()
        with paused_gc():  # from the manifest's parse on: its per-tensor entries are young objects too
            info = path if isinstance(path, DeltaInfo) else open_delta(path, files=files)
            encoding = self._check_lineage(info.manifest, version, base_version, current_version)
            # Lazily, a param at a time, and only the blocks meeting this rank's shard.
            owned = self._owned()
            deltas = iter_delta(info, expected=self.checkpoint, files=files,
                                current_version=current_version if encoding.needs_base else None,
                                owned=owned, lazy=True, threads=decode_threads or torch.get_num_threads(),
                                batches=True)
            staged = self.stage(info.manifest, deltas, version=version, replay=version == current_version,
                                start=start, chunk_bytes=chunk_bytes, decoded=owned)
            # Freed while the collector is still paused: else its first pass walks a few objects a tensor.
            del info, deltas
        return staged

    def prepare_flushes(self, manifest: Manifest, flushes: Iterable[tuple[str, bytes]], *, version: int,
                        base_version: int | None, current_version: int,
                        chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> StagedUpdate:
        """The same as `prepare`, for flush bytes that arrived another way (a collective broadcast)."""
        start = time.perf_counter()
        encoding = self._check_lineage(manifest, version, base_version, current_version)
        names = [f.name for f in manifest.files]
        decoder = DeltaDecoder(manifest, expected=self.checkpoint,
                               current_version=current_version if encoding.needs_base else None)
        owned = self._owned()

        def deltas():
            # One flush at a time (a collective receives each as it is asked for): checked by name
            # as it comes, decoded, then dropped.
            n = 0
            for name, data in flushes:
                if n >= len(names) or name != names[n]:
                    raise IncompleteDeltaError(f"flush {n} is {name!r}, the manifest lists "
                                               f"{names[n] if n < len(names) else 'no more'}", file=name)
                n += 1
                yield from decoder.feed_iter(name, data, owned=owned, batches=True)
                del data
            if n != len(names):
                raise IncompleteDeltaError(f"received {n} flushes, the manifest lists {len(names)}")
            decoder.finish()

        with paused_gc():
            return self.stage(manifest, deltas(), version=version, replay=version == current_version, start=start,
                              chunk_bytes=chunk_bytes, decoded=owned)

    def owned_ranges(self) -> dict[str, list[tuple[int, int]] | None]:
        """Each tensor's checkpoint ranges this rank decodes (`owned.owned_by_tensor`), worked out once:
        the placements do not change after startup, and redoing it cost ~2 us a tensor every prepare."""
        placements = self.placements
        if self._owned_ranges is None:
            self._owned_ranges = owned_by_tensor(placements)
        return self._owned_ranges

    def _owned(self) -> dict | Destinations:
        """What the reader decodes of each tensor, and where: a batchable tensor whose destinations are all
        on one accelerator (or `batched.FORCE_DEVICE_PATH`) is decoded there (wire/batch_device.py),
        unless a segment holds strided ids (a column shard): its blocks span the whole tensor, so on the
        device all their entries would cross to keep 1/TP; decoded on the host, only the owned cross."""
        owned = self.owned_ranges()
        if not any(on_device(t.device) for t in self.targets.values()):
            return owned
        if self._decode_devices is None or self._decode_devices[0] is not self.ownership:  # once per ownership
            devices = {}
            for name, (kind, landed) in self._routes().items():
                if kind != _BATCH or not all(landing.dense for _, landing in landed[1]):
                    continue
                where = {self.targets[seg.target].device for seg, _ in landed[1]}
                if len(where) == 1 and on_device(device := next(iter(where))):
                    devices[name] = device
            self._decode_devices = (self.ownership, devices)
        return Destinations(owned, self._decode_devices[1])

    @staticmethod
    def _check_lineage(manifest: Manifest, version: int, base_version: int | None, current_version: int):
        encoding = get_encoding(manifest.encoding)
        if manifest.version != version:
            raise VersionError(f"request says version {version}, the delta is version {manifest.version}")
        if base_version is not None and base_version != current_version:
            raise VersionError(f"base_version {base_version} != engine version {current_version}")
        replay = version == current_version
        if version < current_version or (replay and not encoding.idempotent):
            raise VersionError(f"version {version} cannot be applied at engine version {current_version}"
                               + (" (a base-relative delta applies exactly once)" if replay else ""))
        return encoding

    def stage(self, manifest: Manifest, deltas: Iterable[ParamDelta | DeltaBatch], *, version: int, replay: bool,
              start: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES, decoded: Mapping | None = None) -> StagedUpdate:
        """Locate decoded (validated) changes and sum their digests: one path, whatever carried the bytes.

        `decoded`: the reader's `owned`; a `Destinations` has the checks of the entries decoded on a
        device, verified (one copy per device) before anything staged is returned.

        Decoded tensors are gathered into batches of about `BATCH_BYTES`; each batch is located,
        digested and staged with a constant number of ops per destination (engine/batched.py).
        Tensors whose elements this rank may count twice (held twice here, or also by a lower
        rank) keep their own counted-once masks, a tensor at a time. A `DeltaBatch` (wire/flush.py) is
        taken whole where all of its tensors are batched (`_take_whole`), else a tensor at a time.
        """
        params = manifest.params
        names = list(map(attrgetter("name"), params))
        entries = dict(zip(names, params))
        staging = _Staging(chunk_bytes)
        sums = _Sums()
        fallback: list[str] = []
        total = 0
        blocks = [0, 0]
        anchor = self._is_anchor(manifest)
        batch: list[ParamDelta | _Planned] = []
        held = 0
        placements, routes, wanted = self.placements, self._routes(), sums.names
        there = decoded.decoded if isinstance(decoded, Destinations) else ()
        if self._plans[0] is routes:  # plans this sync does not use again are dropped after it
            self._plans = (routes, self._plans[2], {})
        for item in deltas:
            if type(item) is DeltaBatch:
                plan = self._take_whole(item, entries, there, wanted)
                if plan is not None:
                    total += item.total
                    blocks[0] += item.blocks[0]
                    blocks[1] += item.blocks[1]
                    batch.append(_Planned(item, plan))
                    held += item.nbytes
                    if held >= BATCH_BYTES:
                        self._stage_batch(batch, entries, staging, sums, decoded)
                        batch, held = [], 0
                    continue
                for delta in item.deltas():
                    batch, held = self._stage_one(delta, entries, staging, sums, decoded, fallback, blocks,
                                                  anchor, batch, held)
                    total += delta.total
                continue
            batch, held = self._stage_one(item, entries, staging, sums, decoded, fallback, blocks, anchor,
                                          batch, held)
            total += item.total
        self._stage_batch(batch, entries, staging, sums, decoded)
        if isinstance(decoded, Destinations):
            decoded.verify()
        return StagedUpdate(
            version=version, writes=staging.writes, fallback=fallback, total_changed=total, changed=staging.changed,
            bytes_read=sum(f.bytes for f in manifest.files), decode_s=time.perf_counter() - start,
            replay=replay, chunk_bytes=chunk_bytes, staged_bytes=staging.nbytes,
            digests=sums.hex(),
            expected=_expected(names, list(zip(map(_PRE, params), map(_POST, params)))),
            after=dict(zip(names, zip(map(attrgetter("digest"), params), map(attrgetter("post_hash"), params)))),
            blocks=(blocks[0], blocks[1]),
            anchor=anchor,
        )

    def _take_whole(self, item: DeltaBatch, entries: Mapping[str, object], there,
                    wanted: dict[str, tuple[bool, bool]]) -> _Plan | None:
        """Note a decoded batch's wanted digests and take it whole for `_stage_batch` (its plan), when
        every tensor of it is batched and decoded on the host (with `stage`'s checks of each tensor's
        pre_digest); None (nothing noted): `stage` takes it a tensor at a time."""
        names = item.names
        plan = self._plan(item)
        if plan is None or (there and not there.isdisjoint(names)):
            return None
        listed = list(map(entries.__getitem__, names))
        pres, posts = list(map(_PRE, listed)), list(map(_POST, listed))
        # A pre_digest is summed on served values cast back: checked where a segment's dtype differs.
        for i in plan.odd:
            if pres[i] is not None:
                for seg in self.placements[names[i]].segments:
                    _check_resolvable(seg.target, self.targets[seg.target].dtype, _Named(names[i], item.dtypes[i]),
                                      "its pre_digest", "checked")
        flags = list(zip(map(is_not, pres, repeat(None)), map(is_not, posts, repeat(None))))
        wanted.update(zip(names, flags) if _NEITHER not in flags else
                      [(n, f) for n, f in zip(names, flags) if f != _NEITHER])
        return plan

    def _stage_one(self, delta: ParamDelta, entries, staging: _Staging, sums: _Sums, decoded, fallback: list[str],
                   blocks: list[int], anchor: bool, batch: list, held: int) -> tuple[list, int]:
        """`stage` of one decoded tensor: replayed, masked, or held in `batch` (staged once it holds
        `BATCH_BYTES`); the batch and its bytes after it."""
        placements, routes, wanted = self.placements, self._routes(), sums.names
        name = delta.name
        decoded_blocks, indexed = delta.blocks
        blocks[0] += decoded_blocks
        blocks[1] += indexed
        entry = entries[name]
        want = (entry.pre_digest is not None, entry.post_digest is not None)
        if want[0] or want[1]:
            wanted[name] = want  # the tensor's digests, in _Sums.names
        kind, landed = routes[name]
        # The pre_digest is summed on served values cast back (checked where a segment's dtype differs).
        if want[0] and kind != _FALLBACK and not landed[2]:
            for seg in placements[name].segments:
                _check_resolvable(seg.target, self.targets[seg.target].dtype, delta, "its pre_digest", "checked")
        if kind == _FALLBACK:
            fallback.append(name)
            acc = [None, None] if any(want) else None
            self._stage_replayed(delta, staging, acc, want, anchor)
            sums.add_tensor(name, acc)
        elif kind == _BATCH:
            batch.append(delta)
            held += delta.positions.nbytes + delta.values.nbytes
            if held >= BATCH_BYTES:
                self._stage_batch(batch, entries, staging, sums, decoded)
                batch, held = [], 0
        else:
            self._stage_masked(delta, want, staging, sums)
        return batch, held

    def _batchable(self, name: str) -> bool:
        """Every element of `name` this rank holds is held once here and by no lower rank, so its
        counted-once share is simply every entry it locates (no per-element mask)."""
        known = self._disjoint.get(name)
        if known is None:
            spans = sorted((s.src_offset, s.src_last) for s in self.placements[name].segments)
            known = self._disjoint[name] = all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
        return known and not self.ownership.lower.get(name)

    def _routes(self) -> dict[str, tuple[int, tuple | None]]:
        """Each tensor's way through `stage` (`_FALLBACK`, `_BATCH` or `_MASKED`) and its `_landings`
        (None for a fallback): worked out once per ownership, since the placements are fixed after
        startup and asking per tensor cost two method calls and four lookups a tensor every prepare."""
        if self._routed is None or self._routed[0] is not self.ownership:
            routes = {}
            for name, placement in self.placements.items():
                routes[name] = ((_FALLBACK, None) if placement.fallback_reason else
                                (_BATCH if self._batchable(name) else _MASKED, self._landings(name)))
            self._routed = (self.ownership, routes)
        return self._routed[1]

    def _landings(self, name: str) -> tuple[int, tuple[tuple[Segment, Landing], ...], bool]:
        """Tensor `name`'s element count, its segments with what locate asks of each, and whether every
        segment's target is served in the checkpoint's dtype (so no `_check_resolvable`): made once."""
        got = self._landed.get(name)
        if got is None:
            placement = self.placements[name]
            numel = torch.Size(placement.shape).numel()
            same = all(self.targets[seg.target].dtype == self.checkpoint[name][1] for seg in placement.segments)
            got = self._landed[name] = (numel, tuple((seg, Landing.of(seg, numel)) for seg in placement.segments),
                                        same)
        return got

    def _plan(self, item: DeltaBatch) -> _Plan | None:
        """How a decoded batch's tensors group by destination (`_Plan`; None: some are not batched):
        worked out once for a run of tensors and kept for the next sync (the same flush layout brings
        the same runs), so a sync pays a `Piece` a (tensor, segment), not its grouping."""
        routes = self._routes()
        if self._plans[0] is not routes:  # a new ownership re-routes: its plans go too
            self._plans = (routes, {}, {})
        _, last, now = self._plans
        key = (tuple(item.names), item.needs_base)
        plan = now[key] if key in now else last.pop(key, None)
        if plan is None or plan.dtypes != item.dtypes:
            plan = _Plan.of(item, routes, self.targets)
        now[key] = plan
        return plan if plan.whole else None

    def _stage_batch(self, batch: list[ParamDelta | _Planned], entries: Mapping[str, object], staging: _Staging,
                     sums: _Sums, decoded: Mapping | None = None) -> None:
        """Locate, digest and stage a batch of tensors: a constant number of ops per destination
        (and per kind of decode: on the device, or on the host, as `decoded` says)."""
        if not batch:
            return
        there = decoded.decoded if isinstance(decoded, Destinations) else ()
        # Per destination, dtype and decode: its pieces, and the tensors behind them (a piece's slot indexes these).
        groups: dict[tuple[str, torch.dtype, bool, bool], tuple[list[Piece], list[str]]] = {}
        # A group a decoded batch feeds: its entries as runs (positions, values, entries a piece), in piece order.
        runs: dict[tuple[str, torch.dtype, bool, bool], list[tuple[torch.Tensor, torch.Tensor, list[int]]]] = {}
        routes = self._routes()
        known: dict[tuple[str, torch.dtype, bool, bool], Known | None] = {}  # a group one plan alone gives
        for delta in batch:
            if type(delta) is _Planned:  # grouped as its plan says (on the host: `stage` takes no other whole)
                delta.plan.add(delta.item, groups, runs, known)
                continue
            name, positions, values, needs_base = delta.name, delta.positions, delta.values, delta.needs_base
            numel, landings, same = routes[name][1]
            kind = (delta.dtype, needs_base, name in there)
            for seg, landing in landings:
                if needs_base and not same:
                    _check_resolvable(seg.target, self.targets[seg.target].dtype, delta)
                key = (seg.target, *kind)
                group = groups.get(key)
                if group is None:  # not setdefault: its two new lists a piece would be garbage nearly always
                    group = groups[key] = ([], [])
                pieces, names = group
                if not names or names[-1] != name:
                    names.append(name)
                pieces.append(Piece(len(names) - 1, positions, values, seg, numel, landing))
                known[key] = None
                if key in runs:
                    runs[key].append((positions, values, [positions.numel()]))
        located_all = []
        for key, (pieces, _) in groups.items():
            target, on_there = key[0], key[3]
            device = self.targets[target].device  # its flat storage's: no view made for it
            got = runs.get(key)
            joined = None if got is None else (_cat([r[0] for r in got]), _cat([r[1] for r in got]),
                                               list(chain.from_iterable(map(itemgetter(2), got))))
            # Off the CPU, located on the device: only the owned positions and values cross (batched.py).
            # Positions decoded there already leave their ownership mask for one count read below.
            located_all.append(locate(pieces, device if on_device(device) else None, defer=True, there=on_there,
                                      entries=joined, known=known.get(key)))
        deferred = [i for i, loc in enumerate(located_all) if loc.keep is not None]
        for i, n in zip(deferred, owned_counts([located_all[i] for i in deferred])):
            located_all[i] = compact(located_all[i], n)
        for ((target, dtype, needs_base, _), (pieces, names)), located in zip(groups.items(), located_all):
            noted = list(map(sums.names.get, names))  # what `stage` noted of each tensor's digests
            if None in noted:  # a tensor without digests, or a batch staged other than by `stage`
                noted = [(entries[n].pre_digest is not None, entries[n].post_digest is not None) for n in names]
            pre, post = zip(*noted)
            canon = self.targets[target]
            flat = flat_storage(canon)
            device = flat.device
            if not located.offsets.numel():
                continue
            located.offsets = self._permuted(target, located.offsets)
            offsets = located.offsets.to(torch.int32 if flat.numel() < 1 << 31 else torch.int64)
            offsets = offsets.to(device, non_blocking=True)
            values = located.values.to(device, non_blocking=True)
            if any(pre) or any(post):
                positions = located.positions.to(device, non_blocking=True)
                slots = located.slots if isinstance(located.slots, int) else located.slots.to(device, non_blocking=True)
                pre_sums, post_sums = stage_sums(flat, offsets, positions, values, slots, len(names), dtype,
                                                 needs_base, any(pre), any(post))
                if any(pre):
                    sums.add_rows(names, 0, pre, pre_sums)
                if any(post):
                    sums.add_rows(names, 1, post, post_sums)
            staging.add(target, Chunk(offsets, values if needs_base else values.to(canon.dtype),
                                      dtype if needs_base else None))

    def _stage_masked(self, delta: ParamDelta, want: tuple[bool, bool], staging: _Staging, sums: _Sums) -> None:
        """A tensor whose elements may be counted twice: located per segment, its digests masked."""
        placement = self.placements[delta.name]
        located = [(seg.target, idx, self._permuted(seg.target, offsets))
                   for seg in placement.segments for idx, offsets in [seg.locate(delta.positions)]]
        if delta.needs_base:
            self._check_base_dtype(delta, located)
        if any(want):
            acc: list[torch.Tensor | None] = [None, None]
            self._digest(delta, located, acc, *want, staging.bound)
            sums.add_tensor(delta.name, acc)
        for target, idx, offsets in located:
            if idx.numel():
                canon = self.targets[target]
                flat = flat_storage(canon)
                values = delta.values[_run(idx)]
                staging.add(target, Chunk(
                    offsets.to(torch.int32 if flat.numel() < 1 << 31 else torch.int64).to(flat.device),
                    (values if delta.needs_base else values.to(canon.dtype)).to(flat.device),
                    delta.dtype if delta.needs_base else None))

    def _stage_replayed(self, delta: ParamDelta, staging: _Staging, acc: list[torch.Tensor | None] | None,
                        want: tuple[bool, bool], anchor: bool) -> None:
        """Stage a tensor the probe could not map by replaying its loader on its shadow, old and new.

        Every rank holds the whole shadow, so rank 0 alone counts its digests. The live weights
        must equal the replay of the old shadow (unless an anchor overwrites them); the writes are
        the elements the new replay changes.
        """
        name = delta.name
        if name in self.refused:
            raise IncompatibleDeltaError(f"engine refuses updates to this tensor: {self.refused[name]}", param=name)
        shadow = self.shadows[name]
        positions = delta.positions.to(shadow.device)
        old = shadow.view(-1)[positions]
        new = ulp_resolve_tensor(old, delta.values.to(shadow.device)) if delta.needs_base else delta.values.to(shadow)
        if acc is not None and self.rank == 0:
            if want[0]:
                _add(acc, 0, partial_sum(positions, old))
            if want[1]:
                _add(acc, 1, partial_sum(positions, new))
        updated = shadow.clone()
        updated.view(-1)[positions] = new
        storages = self._storages()
        before = replay(self._load_weights, storages, name, shadow, self.targets)
        after = replay(self._load_weights, storages, name, updated, self.targets)
        del updated
        if not same_layout(before, after):
            raise IncompatibleDeltaError("its loader writes other elements for the new values", param=name)
        if not anchor and (target := differs(self.targets, before)) is not None:
            raise IntegrityError(f"pre-apply: live {target} differs from its loader's replay of the checkpoint",
                                 param=name)
        for b, a in zip(before, after):
            base = flat_storage(self.targets[a.target])[a.offsets] if anchor else b.values
            moved = torch.nonzero(bits(a.values) != bits(base)).squeeze(1)
            staging.add(a.target, self._plain_chunk(a.target, a.offsets[moved], a.values[moved]))
        staging.add(shadow_target(name), self._plain_chunk(shadow_target(name), positions, new), counted=False)

    def _plain_chunk(self, target: str, offsets: torch.Tensor, values: torch.Tensor) -> Chunk:
        """New values (the target's dtype) at flat storage offsets, on the target's device."""
        flat = flat_storage(self.targets[target])
        offsets = offsets.to(torch.int32 if flat.numel() < 1 << 31 else torch.int64)
        return Chunk(offsets.to(flat.device), values.to(flat.device, flat.dtype))

    def _is_anchor(self, manifest: Manifest) -> bool:
        """An overwrite of every element of every checkpoint tensor: repairs whatever a fault left."""
        if not get_encoding(manifest.encoding).idempotent:
            return False
        listed = {p.name: p.changed for p in manifest.params}
        return all(listed.get(name) == torch.Size(shape).numel() for name, (shape, _) in self.checkpoint.items())

    def _permuted(self, target: str, offsets: torch.Tensor) -> torch.Tensor:
        """Loaded-layout storage offsets -> where a permuting post-load step moved those elements."""
        if target not in self.offset_maps or not offsets.numel():
            return offsets
        return self.offset_maps[target].live(offsets)

    def _loaded_flat(self, target: str) -> torch.Tensor:
        """The target's flat storage in the loaded layout (undoing a permuting post-load step)."""
        flat = flat_storage(self.targets[target])
        return self.offset_maps[target].loaded(flat) if target in self.offset_maps else flat

    def _check_base_dtype(self, delta: ParamDelta, located: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        for target, idx, _ in located:
            canon = self.targets[target]
            if idx.numel():
                _check_resolvable(target, canon.dtype, delta)

    def _digest(self, delta: ParamDelta, located: list[tuple[str, torch.Tensor, torch.Tensor]],
                acc: list[torch.Tensor | None], pre: bool, post: bool, chunk_bytes: int) -> None:
        """Add this rank's counted-once terms of the changed positions, before and after, on the device.

        In slices of about `chunk_bytes` of device memory (offsets, values and the int64 mixing
        temporaries come to about 64 B per entry).
        """
        held = [(target, idx, offsets) for target, idx, offsets in located if idx.numel()]
        # Masks only where an element can be counted twice: held twice here, or by a lower rank.
        seen = torch.zeros(delta.count, dtype=torch.bool) if len(held) > 1 else None
        lower = bool(self.ownership.lower.get(delta.name))
        step = max(1, chunk_bytes // 64)
        for target, idx, offsets in held:
            if seen is not None or lower:
                keep = (self.ownership.counted(delta.name, delta.positions[idx]) if lower
                        else torch.ones(idx.numel(), dtype=torch.bool))
                if seen is not None:
                    keep &= ~seen[idx]
                    seen[idx] = True
                idx, offsets = idx[keep], offsets[keep]
            flat = flat_storage(self.targets[target])
            for lo in range(0, idx.numel(), step):
                part = _run(idx[lo:lo + step])
                pos = delta.positions[part].to(flat.device)
                old = None
                if pre or delta.needs_base:
                    old = gather(flat, offsets[lo:lo + step].to(flat.device)).to(delta.dtype)
                if pre:
                    _add(acc, 0, partial_sum(pos, old))
                if post:
                    values = delta.values[part].to(flat.device)
                    _add(acc, 1, partial_sum(pos, ulp_resolve_tensor(old, values) if delta.needs_base else values))

    # ---- phase 2 -------------------------------------------------------------------------
    def commit(self, staged: StagedUpdate, chunk_bytes: int | None = None) -> float:
        """Scatter the staged entries into the live weights, read them back, and return the seconds it took.

        Each destination's staged chunks (a handful: one per batch) are scattered on the current
        stream. Then every written offset is gathered from the live weights and compared bit for
        bit with what was staged, whose post-digests the route checked against the manifest: a
        write that did not land is a fault, not a silent difference. The time includes a device
        synchronize, so it is the pause on an accelerator too.
        """
        start = time.perf_counter()
        written: list[str] = []
        checks: list[tuple[str, torch.Tensor]] = []
        target = None
        try:
            for target, chunks in staged.writes.items():
                written.append(target)
                flat = flat_storage(self.targets[target])
                missed = None
                while chunks:
                    for part in _blocks(flat, chunks.popleft()):
                        new = scatter(flat, part)
                        differ = read_back(flat, part.offsets, new)
                        missed = differ if missed is None else missed | differ
                if missed is not None:
                    checks.append((target, missed))
            target = None
            self._refresh_cpu_kernels(staged)
            synchronize({self.targets[t].device for t in written})
        except Exception as exc:
            raise ApplyFault(f"scatter failed{f' at {target}' if target else ''}: {type(exc).__name__}: {exc}",
                             failed_at=target, suspect=written) from exc
        wrong = _read_back(checks)
        if wrong:
            raise ApplyFault(f"post-commit read-back: {len(wrong)} live tensor(s) do not hold the values written "
                             f"({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''})",
                             failed_at=wrong[0], suspect=wrong)
        return time.perf_counter() - start

    def _refresh_cpu_kernels(self, staged: StagedUpdate) -> None:
        # A module is touched when a write lands anywhere under it: a derived tensor (MLA's W_UV
        # on the attention module) comes from a child's weight (kv_b_proj).
        touched = {t.rsplit(".", i)[0] for t in staged.writes for i in range(1, t.count(".") + 1)}
        modules = [m for name, m in self.model.named_modules() if name in touched and cpu_weights.needs_refresh(m)]
        if modules:
            cpu_weights.refresh(modules)
        derived.rederive_touched(self.model, staged.writes)  # then what attention / model steps derive

    # ---- full verify, on demand ----------------------------------------------------------
    def rebuild(self, name: str) -> torch.Tensor | None:
        """The full checkpoint tensor as this rank holds it, or None if it holds only part.

        Each segment is a strided block on both sides, so this is one strided copy per segment.
        """
        placement = self.placements[name]
        whole = None if placement.fallback_reason else placement.whole_target()
        if whole is None:
            return None
        target, segments = whole
        numel = torch.Size(placement.shape).numel()
        flat = self._loaded_flat(target)
        if len(segments) == 1 and segments[0].src_offset == 0 and segments[0].dst_strides == segments[0].src_strides \
                and flat.dtype == placement.dtype:
            # Stored exactly as in the checkpoint (a whole param, or a row block of a packed one).
            start = segments[0].dst_offset
            return flat[start:start + numel].view(placement.shape)
        out = torch.empty(numel, dtype=placement.dtype, device=flat.device)
        for seg in segments:
            src = torch.as_strided(flat, seg.sizes, seg.dst_strides, seg.dst_offset)
            torch.as_strided(out, seg.sizes, seg.src_strides, seg.src_offset).copy_(src)
        return out.reshape(placement.shape)

    def whole_partial(self, name: str) -> str | None:
        """This rank's counted-once additive digest of tensor `name` as held now (None: held nowhere here)."""
        placement = self.placements[name]
        if placement.fallback_reason:
            return self._replayed_partial(name)
        total = torch.zeros(2, dtype=torch.int64)
        earlier = []
        for seg in placement.segments:
            flat = self._loaded_flat(seg.target)
            total = total.to(flat.device)
            for pos, values in segment_chunks(seg, flat):
                keep = self.ownership.counted(name, pos)
                for lat in earlier:  # an element this rank holds twice counts once
                    keep &= ~contains(lat, pos)
                total += partial_sum(pos[keep], values[keep].to(placement.dtype))
            earlier.append(lattice(seg))
        return to_hex(total)

    def _replayed_partial(self, name: str) -> str | None:
        """A replayed tensor's share: rank 0 counts its shadow; a rank whose live weights differ from
        the shadow's replay counts the shadow once more, so the sum across ranks cannot match."""
        shadow = (self.shadows or {}).get(name)
        if shadow is None:
            return None
        drift = differs(self.targets, replay(self._load_weights, self._storages(), name, shadow, self.targets))
        copies = int(self.rank == 0) + int(drift is not None)
        return to_hex(tensor_sum(shadow) * copies) if copies else None

    def post_hash_mismatches(self, post_hashes: Mapping[str, str]) -> tuple[int, list[str]]:
        """xxh3 of every tensor this rank holds whole, against `post_hashes`: (checked, mismatched)."""
        checked, bad = 0, []
        for name, expected in post_hashes.items():
            tensor = self.rebuild(name)
            if tensor is None:
                continue
            checked += 1
            if tensor_digest(tensor) != expected:
                bad.append(name)
        return checked, bad


def _blocks(flat: torch.Tensor, chunk: Chunk) -> Iterator[Chunk]:
    """The chunk in blocks of `CPU_BLOCK` entries where the compiled commit takes it, else whole.

    Why: each block is read back (a separate pass over the live weights, kernels/scatter.py)
    right after its writes, while the lines it wrote are still in cache: at 2% density on a 1 GB
    model about a third less time than a write pass and then a read-back pass over the whole chunk."""
    n = chunk.offsets.numel()
    if n <= CPU_BLOCK or not scatter_kernel.takes(flat, chunk.offsets, chunk.values):
        yield chunk
        return
    for lo in range(0, n, CPU_BLOCK):
        yield Chunk(chunk.offsets[lo:lo + CPU_BLOCK], chunk.values[lo:lo + CPU_BLOCK], chunk.base)


def scatter(flat: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """Write one staged chunk into a flat storage view (resolving ULP steps there); returns the values written.

    CPU tensors go through the compiled loop (kernels/scatter.py) where it applies; this torch
    path is its reference, and what every other device runs."""
    if scatter_kernel.takes(flat, chunk.offsets, chunk.values):
        new = scatter_kernel.scatter(flat, chunk.offsets, chunk.values, chunk.base)
        if new is not None:
            return new
    offsets = chunk.offsets.to(flat.device, non_blocking=True).to(torch.int64)
    values = chunk.values.to(flat.device, non_blocking=True)
    if chunk.base is not None:
        values = ulp_resolve_tensor(gather(flat, offsets).to(chunk.base), values)
    values = values.to(flat.dtype)
    if flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no fp8 index_copy_ on the CPU: copy the bits
        bits(flat).index_copy_(0, offsets, bits(values))
    else:
        flat.index_copy_(0, offsets, values)
    return values


def stage_sums(flat: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
               slots: torch.Tensor | int, n: int, dtype: torch.dtype, needs_base: bool, pre: bool,
               post: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """int64[n, 2] digest lane sums per slot of the old values at `offsets` (as `dtype`; if `pre`)
    and of the new ones (`values`, or ULP steps resolved on the old; if `post`)."""
    old = gather(flat, offsets).to(dtype) if pre or needs_base else None
    new = (ulp_resolve_tensor(old, values) if needs_base else values) if post else None
    return (segment_sums(positions, old, slots, n) if pre else None,
            segment_sums(positions, new, slots, n) if post else None)


def read_back(flat: torch.Tensor, offsets: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A bool tensor on flat's device: some live flat[offsets] differ bitwise from `new`. A read of
    the weights after the writes, never the values the scatter computed on its way."""
    if scatter_kernel.takes(flat, offsets, new):
        return scatter_kernel.missed(flat, offsets, new)
    return (bits(gather(flat, offsets.to(flat.device))) != bits(new)).any()


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the queued scatters, so a measured pause is the real one (host and meta need none)."""
    for device in devices:
        if device.type not in ("cpu", "meta"):
            torch.accelerator.synchronize(device)


def _read_back(checks: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Targets whose read-back differed: one device-to-host copy per device (meta holds no values to read)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for target, flag in checks:
        if flag.device.type != "meta":
            by_device.setdefault(flag.device, []).append((target, flag))
    wrong = []
    for items in by_device.values():
        for (target, _), bad in zip(items, torch.stack([f for _, f in items]).cpu().tolist()):
            if bad:
                wrong.append(target)
    return wrong


_PRE, _POST = attrgetter("pre_digest"), attrgetter("post_digest")
_NEITHER = (False, False)  # a tensor with no digest to sum


def _expected(names: list[str], pairs: list[tuple[str | None, str | None]]) -> dict[str, list[str | None]]:
    """`StagedUpdate.expected`: each tensor's (pre, post) digests as a list, where it has either; made
    without a Python loop a tensor (one was ~0.5 us a tensor at 44k)."""
    return dict(compress(zip(names, map(list, pairs)), map((None, None).__ne__, pairs)))


class _Named(NamedTuple):
    """What `_check_resolvable` reads of a delta."""

    name: str
    dtype: torch.dtype


@dataclass(frozen=True)
class _Plan:
    """A decoded batch's tensors grouped as `_stage_batch` groups them, worked out once for a run of
    tensors: per destination key, the tensors behind it in slot order and its `Piece`s (no tensors of
    their own), and for all pieces in group order the param each takes its entries from; and the
    `_check_resolvable` calls its base-relative steps need."""

    dtypes: list[torch.dtype]
    whole: bool  # every tensor is batched (else the rest is empty: `stage` takes it a tensor at a time)
    odd: list[int]  # tensors served in another dtype on some segment (`stage` checks their pre_digest)
    keys: list[tuple[str, torch.dtype, bool, bool]]
    tensors: list[list[str]]
    pieces: list[list[Piece]]
    types: list[object]  # each group's key into the batch's `values`
    order: np.ndarray  # int64 [pieces]: each piece's param in the batch
    bounds: list[int]  # group g's pieces are order[bounds[g]:bounds[g + 1]]
    checks: list[tuple[str, torch.dtype, str, torch.dtype]]
    known: list[Known]  # per group: what locate works out of its pieces alone, once for every sync

    @classmethod
    def of(cls, item: DeltaBatch, routes: Mapping[str, tuple], targets: Mapping[str, torch.Tensor]) -> _Plan:
        groups: dict[tuple, tuple[list[str], list[Piece], list[int], object]] = {}
        checks, odd = [], []
        needs_base = item.needs_base
        if any(routes.get(name, (None,))[0] != _BATCH for name in item.names):
            return cls(list(item.dtypes), False, [], [], [], [], [], np.zeros(0, dtype=np.int64), [0], [], [])
        for i, (name, dtype, vtype) in enumerate(zip(item.names, item.dtypes, item.types)):
            numel, landings, same = routes[name][1]
            if not same:
                odd.append(i)
            for seg, landing in landings:
                if needs_base and not same:
                    checks.append((seg.target, targets[seg.target].dtype, name, dtype))
                key = (seg.target, dtype, needs_base, False)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = ([], [], [], vtype)
                tensors, pieces, params, _ = group
                if not tensors or tensors[-1] != name:
                    tensors.append(name)
                pieces.append(Piece(len(tensors) - 1, None, None, seg, numel, landing))
                params.append(i)
        values = list(groups.values())
        return cls(list(item.dtypes), True, odd, list(groups), [g[0] for g in values], [g[1] for g in values],
                   [g[3] for g in values], np.array([i for g in values for i in g[2]], dtype=np.int64),
                   np.cumsum([0] + [len(g[2]) for g in values]).tolist(), checks, [Known() for _ in values])

    def add(self, item: DeltaBatch, groups: dict, runs: dict, known: dict) -> None:
        """Put the batch's pieces and entries into `_stage_batch`'s groups: one gather of the batch's
        positions and values per group, whatever the tensors behind it. `known[key]`: the group's
        `Known` where this plan alone gives its pieces (its own piece list), else None."""
        for target, served, name, dtype in self.checks:
            _check_resolvable(target, served, _Named(name, dtype))
        sizes = np.array(item.sizes, dtype=np.int64)
        length = sizes[self.order]  # entries of each piece
        end = np.cumsum(length)
        total = int(end[-1]) if end.size else 0
        # Each piece's entries, in group order: its param's run of the batch's entries.
        index = torch.from_numpy(np.repeat((np.cumsum(sizes) - sizes)[self.order] - (end - length), length)
                                 + np.arange(total, dtype=np.int64))
        at = np.concatenate(([0], end))[self.bounds].tolist()
        counts = length.tolist()
        b = self.bounds
        for g, key in enumerate(self.keys):
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [])
                known[key] = self.known[g]
            else:
                known[key] = None
            pieces, names = group
            if key not in runs:  # a group of per-tensor deltas so far: their entries as runs, in order
                runs[key] = [(p.positions, p.values, [p.positions.numel()]) for p in pieces]
            base = len(names)
            names.extend(self.tensors[g])
            pieces.extend(self.pieces[g] if not base else
                          [Piece(base + p.slot, None, None, p.seg, p.numel, p.landing) for p in self.pieces[g]])
            sub = index[at[g]:at[g + 1]]
            runs[key].append((item.positions.index_select(0, sub), item.values[self.types[g]].index_select(0, sub),
                              counts[b[g]:b[g + 1]]))


class _Planned(NamedTuple):
    """A decoded batch `stage` takes whole, with its plan."""

    item: DeltaBatch
    plan: _Plan


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _run(idx: torch.Tensor) -> torch.Tensor | slice:
    """Increasing indices as a slice when they are consecutive (a dense segment's): a view, not a gather."""
    if idx.numel() and int(idx[-1]) - int(idx[0]) + 1 == idx.numel():
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _check_resolvable(target: str, served: torch.dtype, delta: ParamDelta, what: str = "a base-relative step",
                      done: str = "resolved") -> None:
    """Refuse (422, before any write) a base-relative step, or a pre_digest, on served values that do
    not convert back to the checkpoint's exactly.

    Why: the step is resolved (the pre_digest summed) on the served value cast to the delta's
    dtype. That recovers the checkpoint's bits only where the served dtype holds every value of the
    checkpoint's exactly: the same dtype, or a float at least as precise with at least its range
    (bf16 or fp16 served as float32). Not for bf16 <-> fp16 (fp16 rounds bf16's small values), a
    narrower float, or any integer of another dtype.
    """
    sent = delta.dtype
    if served == sent:
        return
    if served.is_floating_point and sent.is_floating_point:
        a, b = torch.finfo(served), torch.finfo(sent)
        if a.eps <= b.eps and a.max >= b.max and a.tiny * a.eps <= b.tiny * b.eps:
            return
    hint = "send an overwrite encoding" if done == "resolved" else "send it without pre digests"
    raise DtypeMismatchError(f"{target} is served as {served}, the delta's values are {sent}: {what} cannot be "
                             f"{done} exactly on the served values ({hint})", param=delta.name)


class StagingBoundError(IncompatibleDeltaError):
    """The staged update would exceed the receiver's bound (--delta-updates-chunk-bytes)."""

    http_status = 413


class _Staging:
    """Staged chunks per destination, refused past `bound` bytes in total (so an update never OOMs)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.writes: dict[str, deque[Chunk]] = {}
        self.nbytes = 0
        self.changed = 0

    def add(self, target: str, chunk: Chunk, counted: bool = True) -> None:
        self.nbytes += chunk.offsets.nbytes + chunk.values.nbytes
        if self.nbytes > self.bound:
            raise StagingBoundError(
                f"the staged update needs more than --delta-updates-chunk-bytes={self.bound} bytes (the bound on "
                f"everything an update stages); send smaller updates or raise the bound", param=target)
        if counted:
            self.changed += chunk.offsets.numel()
        self.writes.setdefault(target, deque()).append(chunk)


class _Sums:
    """This rank's digest lane sums per tensor, kept on the device as batched rows until one copy at the end."""

    def __init__(self) -> None:
        self.names: dict[str, tuple[bool, bool]] = {}
        self.rows: list[tuple[list[str | None], int, torch.Tensor]] = []  # (name per row, lane, int64[n, 2])

    def add_rows(self, names: list[str], lane: int, wanted: list[bool], sums: torch.Tensor) -> None:
        """Row i is tensor `names[i]`'s where `wanted[i]`, else no tensor's (None)."""
        self.rows.append((list(map(getitem, zip(repeat(None), names), wanted)), lane, sums))

    def add_tensor(self, name: str, acc: list[torch.Tensor | None] | None) -> None:
        for lane, t in enumerate(acc or ()):
            if t is not None:
                self.rows.append(([name], lane, t.reshape(1, 2)))

    def hex(self) -> dict[str, list[str | None]]:
        """Hex digests, with one device-to-host copy per device and no Python object per row (so a
        6k-tensor update does not set off the garbage collector: 0.25 s with a list per row)."""
        ids = dict(zip(self.names, count()))
        row_of = {**ids, None: -1}  # a row's name: None where its tensor has no such digest
        total = np.zeros((len(ids), 2, 2), dtype=np.uint64)  # tensor, pre/post, the digest's two lanes
        held = np.zeros((len(ids), 2), dtype=bool)
        by_device: dict[torch.device, list[tuple[list[str | None], int, torch.Tensor]]] = {}
        for row in self.rows:
            by_device.setdefault(row[2].device, []).append(row)
        for rows in by_device.values():
            values = torch.cat([t for _, _, t in rows]).cpu().numpy().view(np.uint64)
            tensor = np.fromiter(map(row_of.__getitem__, chain.from_iterable(names for names, _, _ in rows)),
                                 dtype=np.int64, count=len(values))
            lane = np.repeat(np.array([lane for _, lane, _ in rows]), [len(names) for names, _, _ in rows])
            keep = tensor >= 0
            np.add.at(total, (tensor[keep], lane[keep]), values[keep])  # wraps mod 2^64, as the digest does
            held[tensor[keep], lane[keep]] = True
        text = total.astype(">u8").tobytes().hex()  # to_hex's form: lane 0 then lane 1, 16 digits each
        digits = re.findall(".{32}", text)  # tensor i's pre, then its post (no Python loop a tensor)
        out = dict(zip(ids, map(list, zip(digits[0::2], digits[1::2]))))
        names = list(ids)
        for i, lane in zip(*np.nonzero(~held)):  # a digest not summed here
            out[names[i]][lane] = None
        return out


def _add(acc: list[torch.Tensor | None], i: int, part: torch.Tensor) -> None:
    acc[i] = part if acc[i] is None else acc[i] + part.to(acc[i].device)
