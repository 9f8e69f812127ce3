"""Seekable position blocks: a param's changes cut into blocks a receiver can skip undecoded, so a
tensor-parallel rank decodes only the blocks meeting what it owns (docs/wire-format.md: where blocks
start, why, and implicit positions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import BoundsError, FormatError
from .flush_meta import Param

SPAN_BITS = 20
MIN_ENTRIES = 8192
MAX_ENTRIES = 65536

Ranges = Sequence[tuple[int, int]]  # inclusive [first, last] position ranges, sorted, disjoint


@dataclass(frozen=True)
class Policy:
    """Where blocks may start: where positions cross a multiple of 2^`span_bits` once a block holds
    `min_entries`; none holds more than `max_entries`. The writer's knob, not part of the format."""

    span_bits: int = SPAN_BITS
    min_entries: int = MIN_ENTRIES
    max_entries: int = MAX_ENTRIES

    def __post_init__(self) -> None:
        if self.max_entries <= 0 or self.max_entries % 8 or self.span_bits < 0:
            raise ValueError("max_entries must be a positive multiple of 8, span_bits >= 0")


def cuts(pos: np.ndarray, policy: Policy = Policy()) -> list[int]:
    """Entry indices where blocks start (the first is 0) for sorted positions `pos`."""
    n = pos.size
    span_bits, min_entries, max_entries = policy.span_bits, policy.min_entries, policy.max_entries
    lo, hi = (int(pos[0]) >> span_bits, int(pos[-1]) >> span_bits) if n else (0, 0)
    if hi - lo < n:  # where positions cross each window edge: a search per edge, not a pass over pos
        edges = np.arange(lo + 1, hi + 1, dtype=np.int64) << span_bits
        candidates = np.unique(np.searchsorted(pos, edges)) & ~7
    else:
        window = pos >> span_bits
        candidates = (np.flatnonzero(window[1:] != window[:-1]) + 1) & ~7
    starts = [0]
    for c in candidates.tolist():
        if c - starts[-1] >= min_entries and n - c > 0:
            starts.append(c)
    out: list[int] = []
    for a, b in zip(starts, [*starts[1:], n]):
        out.extend(range(a, b, max_entries))
    return out


def dense_cuts(ranges: Sequence[tuple[int, int]], policy: Policy = Policy()) -> list[tuple[int, int, int]]:
    """Blocks of dense `(start, length)` runs: `(first position, offset into the run's values, count)`."""
    m = policy.max_entries
    out, offset = [], 0
    for start, length in ranges:
        a, end = start, start + length
        while a < end:
            b = min(end, (a // m + 1) * m)
            out.append((a, offset + a - start, b - a))
            a = b
        offset += length
    return out


@dataclass(frozen=True)
class BlockIndex:
    """A param's blocks, validated: positions, counts and per-stream byte lengths as arrays."""

    first: np.ndarray  # int64 [blocks]
    last: np.ndarray
    count: np.ndarray
    stored: np.ndarray  # int64 [blocks, streams]: bytes on the wire
    decoded: np.ndarray  # int64 [blocks, streams]: bytes after decompression

    @property
    def size(self) -> int:
        return int(self.first.size)


def parse_index(p: Param, numel: int, *, file: str | None) -> BlockIndex:
    """Check param `p`'s `blocks` metadata: [[first, last, count, [stored, decoded] * streams], ...]; with
    implicit positions (width 0) every block dense, counts any."""
    rows, streams, count, param, implicit = p.blocks, len(p.streams), p.count, p.name, p.width == 0
    if (
        not isinstance(rows, list)
        or not rows
        or not all(isinstance(r, list) and len(r) == 4 and isinstance(r[3], list) for r in rows)
        or not all(type(x) is int for r in rows for x in (r[0], r[1], r[2], *r[3]))
    ):
        raise FormatError("bad block index", file=file, param=param)
    try:
        head = np.array([r[:3] for r in rows], dtype=np.int64)
        lens = np.array([r[3] for r in rows], dtype=np.int64)
    except (ValueError, OverflowError):
        raise FormatError("bad block index", file=file, param=param) from None
    first, last, cnt = head[:, 0], head[:, 1], head[:, 2]
    if lens.ndim != 2 or lens.shape[1] != 2 * streams:
        raise FormatError(
            f"block index lists {lens.shape[-1] if lens.ndim == 2 else '?'} lengths for {streams} streams",
            file=file,
            param=param,
        )
    stored, decoded = lens[:, 0::2], lens[:, 1::2]
    if int(first[0]) < 0 or int(last[-1]) >= numel:
        raise BoundsError(f"block index: position out of range [0, {numel})", file=file, param=param)
    if not (
        bool((first <= last).all())
        and bool((last[:-1] < first[1:]).all())
        and bool((cnt <= last - first + 1).all())
    ):
        raise BoundsError("block index: positions are not strictly increasing", file=file, param=param)
    if implicit and not bool((cnt == last - first + 1).all()):
        raise BoundsError("block index: a block of implicit positions is not dense", file=file, param=param)
    if not (
        bool((cnt >= 1).all())
        and int(cnt.sum()) == count
        and (implicit or bool((cnt[:-1] % 8 == 0).all()))
        and bool((lens >= 0).all())
    ):
        raise FormatError(
            f"block index: counts do not partition the param's {count} changes "
            "in multiples of 8, or a length is negative",
            file=file,
            param=param,
        )
    return BlockIndex(first, last, cnt, stored, decoded)


def wanted(index: BlockIndex, owned: Ranges | None) -> np.ndarray:
    """Which blocks meet any of the `owned` ranges (all of them when `owned` is None)."""
    if owned is None:
        return np.ones(index.size, dtype=bool)
    if not owned:
        return np.zeros(index.size, dtype=bool)
    lo = np.array([a for a, _ in owned], dtype=np.int64)
    hi = np.array([b for _, b in owned], dtype=np.int64)
    k = np.searchsorted(hi, index.first)  # the first range ending at or after the block's first
    inside = k < hi.size
    return inside & (lo[np.minimum(k, hi.size - 1)] <= index.last)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal [start, stop) runs of True."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def merge(ranges: Ranges) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-adjacent inclusive ranges covering the same positions."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
