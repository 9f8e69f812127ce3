"""Two-phase in-place apply of a delta on one rank: prepare (read, verify, decode, locate, digest,
stage) while the engine serves, then commit (scatter into the live parameters) in the pause, so that
bad input fails before any weight changes and a commit failure is a reported engine fault.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from vllm_delta import wire
from vllm_delta.engine import commit as commit_phase
from vllm_delta.engine import derived, loaders, transforms
from vllm_delta.engine.batched import on_device
from vllm_delta.engine.cli_args import DEFAULT_MAX_STAGED_BYTES
from vllm_delta.engine.digests import Ownership, lattice, segment_chunks
from vllm_delta.engine.fallback import Shadows
from vllm_delta.engine.placement import TensorPlacement, derived_params, owned_by_tensor, unreached
from vllm_delta.engine.probe import PeakRss, build_placement
from vllm_delta.engine.routing import Routing
from vllm_delta.engine.stager import Stager
from vllm_delta.engine.staging import StagedUpdate
from vllm_delta.engine.trace import WORKER_PREPARE, PhaseTimes
from vllm_delta.wire import DeltaInfo, Manifest, ParamDelta
from vllm_delta.wire.additive import partial_sum, to_hex
from vllm_delta.wire.batch_device import HOST, Decoder
from vllm_delta.wire.container import paused_gc
from vllm_delta.wire.deltas import DeltaBatch
from vllm_delta.wire.lineage import check_versions

logger = logging.getLogger(__name__)


class DeltaApplier:
    """Applies deltas to one model on one rank, through placements learned once per model."""

    def __init__(
        self,
        model: nn.Module,
        checkpoint: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
        *,
        placements: dict[str, TensorPlacement] | None = None,
        rank: int = 0,
        read: Callable[[str], torch.Tensor] | None = None,
    ) -> None:
        self.model, self.checkpoint, self._placements, self._read = model, dict(checkpoint), placements, read
        # Parameters a post-load step replaced are loaded through their model format (engine/loaders.py).
        self._load_weights = load_weights or loaders.model_format(model)
        self.targets = {n: canon for n, (_, canon) in transforms.canonical_tensors(model).items()}
        # Parameters a post-load step permuted: deltas located in the loaded layout go through their maps.
        self.routing = Routing(self.checkpoint, self.targets, transforms.offset_maps(model))
        self.probe_s: float | None = None
        self.probe_peak_bytes: int | None = None
        # Tensors the probe could not map: their loaders replayed on shadows read with `read` (fallback.py).
        self.shadows = Shadows(self._load_weights, self._storages, self.targets, rank)
        self.refused = self.shadows.refused  # tensors whose loaders cannot be served exactly
        self._shadows_planned = False
        self.coverage: dict[str, object] | None = None  # digests.check_coverage across ranks, at startup
        self._claimed: set[str] | None = None  # the parameters the probe's load_weights said it loaded
        self._owned: dict[str, list[tuple[int, int]] | None] = {}  # owned_by_tensor, with the placement

    @property
    def ownership(self) -> Ownership:
        """The other ranks' coverage (digests.py), handed over by the route; replacing it re-routes."""
        return self.routing.ownership

    @ownership.setter
    def ownership(self, ownership: Ownership) -> None:
        self.routing.ownership = ownership
        if self._shadows_planned:  # at startup (set_peers): the routes now, not in the first sync
            self.routing.routes()

    def _storages(self) -> dict[int, str]:
        """Live parameter storages -> their names: what the probe and the fallback replay record into."""
        live = transforms.canonical_tensors(self.model).items()
        return {t.untyped_storage().data_ptr(): name for name, (t, _) in live if t.numel() > 0}

    @property
    def placements(self) -> dict[str, TensorPlacement]:
        if self._placements is None:
            start = time.perf_counter()
            with PeakRss() as peak:
                self._placements = build_placement(self._noting_loaded, self._storages(), self.checkpoint)
            self.probe_s, self.probe_peak_bytes = time.perf_counter() - start, peak.extra
            message = "delta updates: placement of %d tensors learned in %.2fs (+%s B peak)"
            logger.info(message, len(self._placements), self.probe_s, peak.extra)
        if not self._shadows_planned:
            self._shadows_planned = True
            self.routing.placements = self._placements
            self._plan_fallbacks()
            self._owned = owned_by_tensor(self._placements)  # at startup, not in the first sync
        return self._placements

    def _noting_loaded(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """The model's `load_weights`, noting the parameters it says it loaded (vLLM's return their names)."""
        loaded = self._load_weights(weights)
        if isinstance(loaded, (set, frozenset, list, tuple)):
            self._claimed = (self._claimed or set()) | {n for n in loaded if isinstance(n, str)}
        return loaded

    def _plan_fallbacks(self) -> None:
        """At startup: shadow every unmapped tensor whose loader replays exactly; refuse the rest. Then hold
        to their size the destinations the loader said it loaded (all, if it said nothing; fp8's `k_scale`
        keeps vLLM's default), but those a post-load step derived."""
        placements = self._placements
        unmapped = {n: p.fallback_reason for n, p in placements.items() if p.fallback_reason}
        read = None if self._read is None else (lambda n: self._read(n).to(placements[n].dtype).contiguous())
        replayed = self.shadows.plan(unmapped, read)
        if not self.refused:  # a refused tensor explains the destinations it leaves unreached
            made = derived_params((t.unit, t.key) for t in derived.discovery(self.model).tensors)
            storages = self._storages()
            wanted = set(storages.values())
            if self._claimed is not None:
                live = transforms.canonical_tensors(self.model).items()
                named = {n: storages.get(t.untyped_storage().data_ptr()) for n, (t, _) in live if t.numel()}
                wanted = {named.get(n) for n in self._claimed} - {None}
            checked = {n: self.targets[n] for n in wanted if n not in made}
            self.refused.update(unreached(placements, checked, replayed))
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
        return {
            "ready": ready,
            "probe_s": self.probe_s,
            "probe_peak_bytes": self.probe_peak_bytes,
            "fallback": self.fallback_tensors if ready else None,
            "refused": self.refused if ready else None,
            "coverage": self.coverage,
            "transformed": sorted(transforms.transformed(self.model)),
            "in_pause": getattr(self.model, commit_phase.IN_PAUSE_ATTR, {}),  # the last commit's re-runs
        }

    def prepare(
        self,
        source: str | Path | DeltaInfo | Manifest,
        flushes: Iterable[tuple[str, bytes]] | None = None,
        *,
        version: int,
        base_version: int | None,
        current_version: int,
        files: list[str] | None = None,
        max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
        decode_threads: int | None = None,
        times: PhaseTimes | None = None,
    ) -> StagedUpdate:
        """Read, verify and decode a delta: a version directory, the `DeltaInfo` the worker opened (`times`
        holding what that took), or a `Manifest` whose `flushes` arrive another way (a collective, checked
        by name); locate, digest and stage each entry this rank owns. Decoded on `decode_threads` threads
        ahead of the staging, the garbage collector paused (~20 us a tensor).
        """
        times = times if times is not None else PhaseTimes()
        start = time.perf_counter() - sum(times.seconds.values())
        with paused_gc():  # from the manifest's parse on: its per-tensor entries are young objects too
            with times.phase("receive"):
                info = source
                if isinstance(source, (str, Path)):
                    info = wire.open_delta(source, files=files)
                manifest = info if isinstance(info, Manifest) else info.manifest
                needs_base = check_versions(
                    manifest, version=version, base_version=base_version, engine_version=current_version
                ).needs_base
                base = current_version if needs_base else None
                # The probe first, if it has not run, then the decoder's routes.
                owned, decoder = self.owned_ranges(), self._decoder()
            read = {"expected": self.checkpoint, "current_version": base, "decoder": decoder}
            if flushes is not None:
                deltas = _received(wire.DeltaDecoder(manifest, **read), flushes, owned)
            else:  # lazily, a param at a time, and only the blocks meeting this rank's shard
                threads = decode_threads or torch.get_num_threads()
                deltas = wire.iter_delta(
                    info, files=files, owned=owned, lazy=True, threads=threads, batches=True, **read
                )
            staged = self.stage(
                manifest,
                deltas,
                version=version,
                replay=version == current_version,
                start=start,
                max_staged_bytes=max_staged_bytes,
                decoder=decoder,
                times=times,
            )
            del info, deltas  # freed while the collector is still paused
        times.add("stage", max(0.0, time.perf_counter() - start - sum(times.seconds.values())))
        return staged

    def owned_ranges(self) -> dict[str, list[tuple[int, int]] | None]:
        """Each tensor's checkpoint ranges this rank decodes, worked out once."""
        self.placements  # noqa: B018 - learned first (the probe, at startup)
        return self._owned

    def _decoder(self) -> Decoder:
        """The reader's back end: the device's, for the tensors `Routing.decode_devices` names, when a
        target is on an accelerator (`on_device`)."""
        if not any(on_device(t.device) for t in self.targets.values()):
            return HOST
        return Decoder(self.routing.decode_devices())

    def stage(
        self,
        manifest: Manifest,
        deltas: Iterable[ParamDelta | DeltaBatch],
        *,
        version: int,
        replay: bool,
        start: float,
        max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
        decoder: Decoder = HOST,
        times: PhaseTimes | None = None,
    ) -> StagedUpdate:
        """Locate, digest and stage decoded changes (stager.py), whatever carried the bytes; build the
        post-load work of what they touch (commit.prebuild_touched)."""
        self.placements  # noqa: B018 - learned first (the probe, at startup)
        stager = Stager(self.routing, self.shadows, manifest, max_staged_bytes, decoder, times)
        stager.run(deltas)
        staged = stager.finish(version=version, replay=replay)
        with staged.times.phase("prebuild"):
            staged.prebuilt = commit_phase.prebuild_touched(self.model, self.targets, staged.writes)
        # The whole prepare; what its timed phases do not cover is the staging's own work.
        staged.decode_s = time.perf_counter() - start
        timed = sum(staged.times.seconds.get(p, 0.0) for p in WORKER_PREPARE if p != "stage")
        staged.times.add("stage", max(0.0, staged.decode_s - timed))
        return staged

    def commit(self, staged: StagedUpdate) -> float:
        """Scatter the staged entries and read them back (commit.py): the seconds it took."""
        return commit_phase.commit(self.model, self.targets, staged)

    def rebuild(self, name: str) -> torch.Tensor | None:
        """The full checkpoint tensor as this rank holds it (a view where it is stored as in the checkpoint,
        else a strided copy a segment), or None."""
        placement = self.placements[name]
        whole = None if placement.fallback_reason else placement.whole_target()
        if whole is None:
            return None
        (target, segments), numel = whole, torch.Size(placement.shape).numel()
        flat, first = self.routing.loaded_flat(target), segments[0]
        if len(segments) == 1 and not first.src_offset and first.dst_strides == first.src_strides:
            if flat.dtype == placement.dtype:
                return flat[first.dst_offset : first.dst_offset + numel].view(placement.shape)
        out = torch.empty(numel, dtype=placement.dtype, device=flat.device)
        for seg in segments:
            src = torch.as_strided(flat, seg.sizes, seg.dst_strides, seg.dst_offset)
            torch.as_strided(out, seg.sizes, seg.src_strides, seg.src_offset).copy_(src)
        return out.reshape(placement.shape)

    def whole_partial(self, name: str) -> str | None:
        """This rank's counted-once additive digest of tensor `name` as held now (None: held nowhere here)."""
        placement = self.placements[name]
        if placement.fallback_reason:
            return self.shadows.partial(name)
        total = torch.zeros(2, dtype=torch.int64)
        earlier = []
        for seg in placement.segments:
            flat = self.routing.loaded_flat(seg.target)
            total = total.to(flat.device)
            for pos, values in segment_chunks(seg, flat):
                keep = self.routing.counted(name, pos, earlier)
                total += partial_sum(pos[keep], values[keep].to(placement.dtype))
            earlier.append(lattice(seg))
        return to_hex(total)

    def post_hash_mismatches(self, post_hashes: Mapping[str, str]) -> tuple[int, list[str]]:
        """xxh3 of every tensor this rank holds whole, against `post_hashes`: (checked, mismatched)."""
        checked, bad = 0, []
        for name, expected in post_hashes.items():
            if (tensor := self.rebuild(name)) is None:
                continue
            checked += 1
            if wire.tensor_digest(tensor) != expected:
                bad.append(name)
        return checked, bad


def _received(
    reader: wire.DeltaDecoder,
    flushes: Iterable[tuple[str, bytes]],
    owned: dict[str, list[tuple[int, int]] | None],
) -> Iterator[ParamDelta | DeltaBatch]:
    """Each flush decoded as it arrives, checked by name against the manifest, then dropped."""
    names = [f.name for f in reader.manifest.files]
    n = 0
    for name, data in flushes:
        if n >= len(names) or name != names[n]:
            raise wire.IncompleteDeltaError(
                f"flush {n} is {name!r}, the manifest lists {names[n] if n < len(names) else 'no more'}",
                file=name,
            )
        n += 1
        yield from reader.feed_iter(name, data, owned=owned, batches=True)
        del data
    if n != len(names):
        raise wire.IncompleteDeltaError(f"received {n} flushes, the manifest lists {len(names)}")
    reader.finish()
