"""Two-phase in-place apply of a delta on one rank: prepare (read, verify, decode, locate), then
commit (scatter into the live parameters).

Why two phases: everything that can fail on bad input (I/O, hashes, bounds, names, shapes,
dtypes, lineage) fails in `prepare`, before any weight changes and while the engine still
serves. `commit` only scatters precomputed (offset, value) pairs, so the engine is held for the
scatter alone and a failure there is an engine fault, reported as dirty, never a silent one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_delta.engine import cpu_weights
from vllm_delta.engine.placement import TensorPlacement, build_placement
from vllm_delta.wire import (DeltaDecoder, IncompleteDeltaError, Manifest, ParamDelta, VersionError, get_encoding,
                             iter_delta, open_delta, tensor_digest)
from vllm_delta.wire.errors import DtypeMismatchError

logger = logging.getLogger(__name__)

Checkpoint = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class ApplyFault(Exception):
    """The scatter or the post-apply check failed: the weights may be partly written."""


@dataclass
class StagedUpdate:
    """Everything `commit` needs, computed in `prepare` without touching a weight."""

    version: int
    # target -> chunks of (storage offsets, values); kept as located, never concatenated, so the
    # working set stays the decoded payload plus its offsets
    writes: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
    fallback: list[ParamDelta]
    post_hashes: dict[str, str]
    total_changed: int
    changed: int  # entries this rank writes
    bytes_read: int
    decode_s: float
    replay: bool

    @property
    def fallback_names(self) -> list[str]:
        return sorted({d.name for d in self.fallback})


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of `t`, so storage offsets index it directly."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))


class DeltaApplier:
    """Applies deltas to one model on one rank, through placements learned once per model."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint,
                 load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None) -> None:
        self.model = model
        self.checkpoint = dict(checkpoint)
        self._load_weights = load_weights or model.load_weights
        self.targets = {name: canon for name, (_, canon) in cpu_weights.canonical_tensors(model).items()}
        self._placements: dict[str, TensorPlacement] | None = None

    @property
    def placements(self) -> dict[str, TensorPlacement]:
        if self._placements is None:
            start = time.perf_counter()
            storages = {live.untyped_storage().data_ptr(): name
                        for name, (live, _) in cpu_weights.canonical_tensors(self.model).items() if live.numel() > 0}
            self._placements = build_placement(self._load_weights, storages, self.checkpoint)
            logger.info("delta updates: placement of %d tensors learned in %.2fs",
                        len(self._placements), time.perf_counter() - start)
        return self._placements

    @property
    def probed(self) -> bool:
        return self._placements is not None

    @property
    def fallback_tensors(self) -> dict[str, str]:
        return {n: p.fallback_reason for n, p in self.placements.items() if p.fallback_reason}

    # ---- phase 1 -------------------------------------------------------------------------
    def prepare(self, path: str | Path, *, version: int, base_version: int | None,
                current_version: int, files: list[str] | None = None) -> StagedUpdate:
        """Read, verify and decode the delta in a version directory; locate each entry this rank owns."""
        start = time.perf_counter()
        info = open_delta(path, files=files)
        encoding = self._check_lineage(info.manifest, version, base_version, current_version)
        deltas = iter_delta(info, expected=self.checkpoint, files=files,
                            current_version=current_version if encoding.needs_base else None)
        return self.stage(info.manifest, deltas, version=version, replay=version == current_version, start=start)

    def prepare_flushes(self, manifest: Manifest, flushes: Iterable[tuple[str, bytes]], *, version: int,
                        base_version: int | None, current_version: int) -> StagedUpdate:
        """The same as `prepare`, for flush bytes that arrived another way (a collective broadcast)."""
        start = time.perf_counter()
        encoding = self._check_lineage(manifest, version, base_version, current_version)
        flushes = list(flushes)
        if [n for n, _ in flushes] != [f.name for f in manifest.files]:
            raise IncompleteDeltaError(f"received {len(flushes)} flushes, the manifest lists {len(manifest.files)}")
        decoder = DeltaDecoder(manifest, expected=self.checkpoint,
                               current_version=current_version if encoding.needs_base else None)

        def deltas():
            for name, data in flushes:
                yield from decoder.feed(name, data)
            decoder.finish()

        return self.stage(manifest, deltas(), version=version, replay=version == current_version, start=start)

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

    def stage(self, manifest: Manifest, deltas: Iterable[ParamDelta], *, version: int, replay: bool,
              start: float) -> StagedUpdate:
        """Locate decoded (validated) changes: one path after the bytes arrive, whatever carried them."""
        writes: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        fallback: list[ParamDelta] = []
        total = 0
        for delta in deltas:
            total += delta.count
            placement = self.placements[delta.name]
            if placement.fallback_reason:
                if delta.needs_base:
                    raise DtypeMismatchError("a base-relative delta cannot go through vLLM's loader "
                                             f"({placement.fallback_reason})", param=delta.name)
                fallback.append(delta)
                continue
            for target, offsets, values in self._locate(placement, delta):
                writes.setdefault(target, []).append((offsets, values))
        post_hashes = {p.name: p.post_hash for p in manifest.params if p.post_hash}
        return StagedUpdate(
            version=version, writes=writes, fallback=fallback, post_hashes=post_hashes,
            total_changed=total, changed=sum(o.numel() for chunks in writes.values() for o, _ in chunks),
            bytes_read=sum(f.bytes for f in manifest.files), decode_s=time.perf_counter() - start,
            replay=replay,
        )

    def _locate(self, placement: TensorPlacement,
                delta: ParamDelta) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        located = [(seg.target, *seg.locate(delta.positions)) for seg in placement.segments]
        values = delta.values
        if delta.needs_base:
            values = self._resolve(delta, located)
        out = []
        for target, idx, offsets in located:
            if idx.numel():
                out.append((target, offsets, values[idx].to(self.targets[target].dtype)))
        return out

    def _resolve(self, delta: ParamDelta,
                 located: list[tuple[str, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """New values from ULP steps and this rank's current bits (owned entries only)."""
        old = torch.zeros(delta.count, dtype=delta.dtype)
        owned = torch.zeros(delta.count, dtype=torch.bool)
        for target, idx, offsets in located:
            canon = self.targets[target]
            if torch.finfo(canon.dtype).bits < torch.finfo(delta.dtype).bits:
                raise DtypeMismatchError(f"{target} holds {canon.dtype}, narrower than {delta.dtype}: "
                                         "the current bits cannot be recovered", param=delta.name)
            old[idx] = flat_storage(canon)[offsets].to(delta.dtype)
            owned[idx] = True
        new = torch.zeros_like(old)
        if owned.any():
            subset = ParamDelta(delta.name, delta.shape, delta.dtype, delta.positions[owned],
                                delta.values[owned], True)
            new[owned] = subset.resolve(old[owned])
        return new

    # ---- phase 2 -------------------------------------------------------------------------
    def commit(self, staged: StagedUpdate, chunk_bytes: int) -> float:
        """Scatter the staged entries into the live weights; returns the seconds it took."""
        start = time.perf_counter()
        try:
            for target, chunks in staged.writes.items():
                flat = flat_storage(self.targets[target])
                for offsets, values in chunks:
                    step = max(1, chunk_bytes // (offsets.element_size() + values.element_size()))
                    for lo in range(0, offsets.numel(), step):
                        flat.index_copy_(0, offsets[lo:lo + step], values[lo:lo + step])
            if staged.fallback:
                self._apply_fallback(staged.fallback, chunk_bytes)
            self._refresh_cpu_kernels(staged)
        except Exception as exc:
            raise ApplyFault(f"scatter failed: {type(exc).__name__}: {exc}") from exc
        self._verify_post_hashes(staged)
        return time.perf_counter() - start

    def _apply_fallback(self, deltas: list[ParamDelta], chunk_bytes: int) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch, load_checkpoint_weight_patches)

        patches = [CheckpointWeightPatch(d.name, d.shape, d.dtype, d.values, d.positions) for d in deltas]
        load_checkpoint_weight_patches(self.model, patches, max_chunk_bytes=chunk_bytes)

    def _refresh_cpu_kernels(self, staged: StagedUpdate) -> None:
        touched = {t.rsplit(".", 1)[0] for t in staged.writes}
        modules = [m for name, m in self.model.named_modules() if name in touched and cpu_weights.needs_refresh(m)]
        if modules:
            cpu_weights.refresh(modules)

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
        flat = flat_storage(self.targets[target])
        if len(segments) == 1 and segments[0].src_offset == 0 and segments[0].dst_strides == segments[0].src_strides \
                and flat.dtype == placement.dtype:
            # Stored exactly as in the checkpoint (a whole param, or a row block of a packed one).
            start = segments[0].dst_offset
            return flat[start:start + numel].view(placement.shape)
        out = torch.empty(numel, dtype=placement.dtype)
        for seg in segments:
            src = torch.as_strided(flat, seg.sizes, seg.dst_strides, seg.dst_offset)
            torch.as_strided(out, seg.sizes, seg.src_strides, seg.src_offset).copy_(src)
        return out.reshape(placement.shape)

    def _verify_post_hashes(self, staged: StagedUpdate) -> None:
        for name, expected in staged.post_hashes.items():
            tensor = self.rebuild(name)
            if tensor is not None and tensor_digest(tensor) != expected:
                raise ApplyFault(f"post-apply hash mismatch for {name}")

