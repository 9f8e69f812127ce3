"""Which checkpoint positions a rank must decode: the ranges its placement segments span.

Why: block-indexed deltas (wire/blocks.py) let a rank skip the blocks of a tensor that lie
outside its shard, so under tensor parallelism each rank decodes about its share, not the
whole delta.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_delta.engine.placement import TensorPlacement
from vllm_delta.wire.blocks import merge


def owned_ranges(placement: TensorPlacement) -> list[tuple[int, int]] | None:
    """Inclusive checkpoint position ranges this rank holds any element of (None: it needs all).

    Each segment contributes its [first, last] id span, a superset of the ids it holds (a
    column shard spans nearly the whole tensor, so only row-like shards skip). A tensor that is
    not mapped to segments (vLLM's loader replays it whole) needs every position.
    """
    if placement.fallback_reason:
        return None
    return merge([(s.src_offset, s.src_last) for s in placement.segments])


def owned_by_tensor(placements: Mapping[str, TensorPlacement]) -> dict[str, list[tuple[int, int]] | None]:
    return {name: owned_ranges(p) for name, p in placements.items()}
