"""The scan's records (producer.py): each shard's staged changes (`Entry`, an anchor's values as
`Anchor`), what moves the snapshot once every engine holds them (`Capture`), and the snapshot state.
Apart from the scan because the publisher reads them without it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

import torch

import vllm_delta.sender.bucket_scan as bucket_scan
from vllm_delta.sender.shards import flat_runs


@dataclass(eq=False)
class Anchor:
    """One shard's captured values, read a piece at a time in HF order while the anchor is encoded: the
    snapshot (nothing writes it until the engines answered) patched with the staged changes. Never staged
    whole: a position and a copy per element cost ~10 B per bf16 element of pinned memory."""

    placement: tuple  # Shard/Segments.describe(): (name, full_shape, dim or None, spans or runs)
    snapshot: torch.Tensor  # flat, local order, version S
    positions: torch.Tensor  # sorted HF flat positions covering every element that differs from it
    values: torch.Tensor  # the captured values there
    staging: torch.device  # where pieces are made (the host)
    ready: object | None = None  # a CUDA event after which the snapshot may be read

    def pieces(self, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """`(HF start, values)` of at most `max_bytes` each, a fresh staging tensor per piece."""
        m = max(1, max_bytes // self.snapshot.element_size())
        stream = None
        if self.snapshot.device.type == "cuda":  # copy beside the trainer's kernels, not behind them
            stream = torch.cuda.Stream(device=self.snapshot.device)
            if self.ready is not None:
                stream.wait_event(self.ready)
        _, full, dim, spans = self.placement
        flat = spans if dim is None else flat_runs(full, dim, spans)
        starts = accumulate((n for _, n in flat), initial=0)  # each run's local start
        for local, (hf, n) in sorted(zip(starts, flat), key=lambda r: r[1][0]):  # in HF order
            for o in range(0, n, m):
                k = min(m, n - o)
                yield hf + o, self._piece(local + o, hf + o, k, stream)

    def _piece(self, local: int, hf: int, k: int, stream) -> torch.Tensor:
        src = self.snapshot[local : local + k]
        if stream is None:
            piece = src.to(self.staging, copy=True)
        else:
            with torch.cuda.stream(stream):
                piece = src.to(self.staging)
        lo, hi = torch.searchsorted(self.positions, self.positions.new_tensor([hf, hf + k])).tolist()
        if hi > lo:  # the capture's changes inside this piece
            piece[(self.positions[lo:hi] - hf).to(piece.device)] = self.values[lo:hi].to(piece.device)
        return piece


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
    post_hash: str | None = None  # xxh3 of the whole tensor (`Producer(post_hash=True)`, whole shards only)
    anchor: Anchor | None = None  # the captured values, read from the snapshot as the anchor is encoded
    scanned: bool = False  # by `Producer.scan`: sorted unique positions, changed bits (the writer trusts it)


@dataclass(eq=False)
class Bucket:
    """One bucket's flat snapshot (members' `ShardState.snapshot`s are views), digests, offsets sent."""

    layout: bucket_scan.Layout
    snapshot: torch.Tensor
    digests: torch.Tensor  # [n, 2]; row i is member i's `ShardState.digest`
    pending: torch.Tensor | None = None  # bucket offsets sent since S while an engine lags


@dataclass(eq=False)
class BucketAdvance:
    bucket: Bucket
    pos: torch.Tensor  # changed bucket offsets
    values: torch.Tensor
    digests: torch.Tensor  # [n, 2] after the change


@dataclass(eq=False)
class Capture:
    """Everything a publish needs, detached from the live weights."""

    entries: list[Entry] = field(default_factory=list)
    buckets: list[BucketAdvance] = field(default_factory=list)
    changed: int = 0
    scan_s: float = 0.0
    stage_s: float = 0.0


@dataclass(eq=False)
class ShardState:
    placement: tuple  # Shard.describe() as seeded; the tensor itself is not kept
    snapshot: torch.Tensor  # flat until bucketed, then its view of the bucket's (2-d at a constant stride)
    digest: torch.Tensor  # additive digest of the snapshot's elements, int64[2]; a row of the bucket's
    pending: torch.Tensor | None = None  # local positions sent since S, between two buckets
