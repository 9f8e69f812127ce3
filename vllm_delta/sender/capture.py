"""The scan's records (producer.py): each shard's staged changes (`Entry`), what moves the snapshot once
every engine holds them (`Capture`), and the per-shard and per-bucket snapshot state. Apart from the
scan because the publisher reads captures and entries without it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import vllm_delta.sender.bucket_scan as bucket_scan
from vllm_delta.sender.anchor import Anchor


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
    # Made by `Producer.scan` from its own diff: positions sorted and unique, new bits != old bits
    # where old values are staged. The writer then skips re-checking that, pass by pass.
    scanned: bool = False


@dataclass(eq=False)
class Advance:
    """What moves the snapshot to the captured version once every engine acknowledged it."""

    local: torch.Tensor  # changed local positions (on the device)
    values: torch.Tensor  # their new values (on the device)
    digest: torch.Tensor  # the shard's additive digest after the change (on the device)


@dataclass(eq=False)
class Bucket:
    """The snapshot of one bucket (`bucket_scan.Layout`): one flat tensor over its span (each member's
    `ShardState.snapshot` is a view of it), the members' digests, and the offsets sent since S."""

    layout: bucket_scan.Layout
    snapshot: torch.Tensor
    digests: torch.Tensor  # [n, 2]; row i is member i's `ShardState.digest`
    pending: torch.Tensor | None = None  # bucket offsets sent since S while an engine lags

    def pending_counts(self) -> list[int]:
        """Catch-up positions per member (on `meta`, which has no values: every member)."""
        if self.pending.device.type == "meta":
            return [1] * len(self.layout.names)
        seg, *_ = bucket_scan.locate(
            tuple(t.to(self.pending.device) for t in self.layout.tables), self.pending
        )
        return (
            torch.zeros(len(self.layout.names), dtype=torch.int64, device=seg.device)
            .index_add_(0, seg, torch.ones_like(seg))
            .tolist()
        )


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
    advance: dict[str, Advance] = field(default_factory=dict)
    buckets: list[BucketAdvance] = field(default_factory=list)
    changed: int = 0
    scan_s: float = 0.0
    stage_s: float = 0.0


@dataclass(eq=False)
class ShardState:
    placement: tuple  # Shard.describe() as seeded; the tensor itself is not kept
    snapshot: torch.Tensor  # flat
    digest: torch.Tensor  # additive digest of the snapshot's elements, int64[2] on the device
    pending: torch.Tensor | None = None  # local positions sent since S while an engine lags
    # A bucket member at a constant stride (a fused qkv's q rows): its 2-d view of the bucket's
    # snapshot, which is what is kept current; `snapshot` is then a flat copy made for each anchor.
    view: torch.Tensor | None = None
