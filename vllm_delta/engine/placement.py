"""Where each checkpoint element lives on this rank (learned by `probe.py`): a `Segment` is an affine
block of one checkpoint tensor copied into one destination, a `Fill` a loader's constant fill of a
region no segment reaches (vocab padding); a `TensorPlacement` holds all of one tensor's."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_delta.wire.blocks import merge


@dataclass(frozen=True)
class Segment:
    """Checkpoint flat id src_offset + sum(i[d] * src_strides[d]) lands at storage offset dst_offset +
    sum(i[d] * dst_strides[d]) of `target`, for 0 <= i[d] < sizes[d]; dims by decreasing src stride,
    so ids invert uniquely (`batched.locate`)."""

    target: str
    sizes: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def src_last(self) -> int:
        return self.src_offset + sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides))


@dataclass(frozen=True)
class Fill:
    """A loader's fill of a destination region (laid out as a `Segment`'s) with a constant `value`."""

    target: str
    sizes: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    value: bool | int | float
    op: str  # the aten op, for the reason where the fill is refused


@dataclass
class TensorPlacement:
    """All destinations of one checkpoint tensor on this rank (empty: this rank holds none of it)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: list[Segment] = field(default_factory=list)
    fallback_reason: str | None = None
    read: bool = True  # whether the loader read it on this rank (not: another EP rank's expert, `inv_freq`)
    fills: list[Fill] = field(default_factory=list)

    def whole_target(self) -> tuple[str, list[Segment]] | None:
        """A destination holding every element, with its segments (so the tensor can be rebuilt here)."""
        numel = torch.Size(self.shape).numel()
        by_target: dict[str, list[Segment]] = {}
        for seg in self.segments:
            by_target.setdefault(seg.target, []).append(seg)
        return next(((t, segs) for t, segs in by_target.items() if sum(s.numel for s in segs) == numel), None)


def owned_by_tensor(placements: Mapping[str, TensorPlacement]) -> dict[str, list[tuple[int, int]] | None]:
    """Per tensor, inclusive checkpoint position ranges spanning what this rank holds (None: it needs all),
    so it decodes only the blocks of a block-indexed delta that meet its shard."""
    return {
        n: None if p.fallback_reason else merge([(s.src_offset, s.src_last) for s in p.segments])
        for n, p in placements.items()
    }


def grid(offset: int, sizes: Iterable[int], strides: Iterable[int], device: Any = None) -> torch.Tensor:
    """offset + sum(i[d] * strides[d]) at every index i of `sizes`, shaped `sizes` (int64)."""
    out = torch.tensor(offset, dtype=torch.int64, device=device)
    for n, s in zip(sizes, strides):
        out = out.unsqueeze(-1) + torch.arange(n, device=device) * s
    return out


def runs(offset: int, sizes: Iterable[int], strides: Iterable[int]) -> torch.Tensor:
    """A lattice's ids (a segment's ids or storage offsets) as sorted [start, end) runs (k x 2);
    trailing dims contiguous in storage make one run."""
    dims = sorted(((n, s) for n, s in zip(sizes, strides) if n > 1), key=lambda d: -d[1])
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = torch.sort(grid(offset, (n for n, _ in dims), (s for _, s in dims)).reshape(-1)).values
    return torch.stack([starts, starts + run], dim=1)


def depth(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """For [start, end) runs: (breakpoints, how many runs hold [breakpoints[i], breakpoints[i + 1]))."""
    held = torch.cat(list(parts))
    points = torch.cat([held[:, 0], held[:, 1]])
    steps = torch.ones(len(held), dtype=torch.int64)
    points, order = torch.sort(points, stable=True)
    level = torch.cumsum(torch.cat([steps, -steps])[order], 0)
    last = torch.ones_like(points, dtype=torch.bool)  # the final depth at each distinct point
    last[:-1] = points[1:] != points[:-1]
    return points[last], level[last]


def union(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Runs merged: what any of them holds, once."""
    points, level = depth(parts)
    covered = level[:-1] > 0
    return torch.stack([points[:-1][covered], points[1:][covered]], dim=1)


def refuse_overlapping_fills(placements: Mapping[str, TensorPlacement]) -> None:
    """Turn into a fallback each tensor whose loader fills elements a segment of any checkpoint tensor
    reaches (only padding may be filled; a fill can meet another tensor's rows, so after every probe)."""
    held: dict[str, list[torch.Tensor]] = {f.target: [] for p in placements.values() for f in p.fills}
    for seg in (s for p in placements.values() for s in p.segments if s.target in held):
        held[seg.target].append(runs(seg.dst_offset, seg.sizes, seg.dst_strides))
    reached = {t: union(r) for t, r in held.items() if r}
    for p in placements.values():
        for fill in p.fills:
            region = union([runs(fill.dst_offset, fill.sizes, fill.dst_strides)])
            if fill.target not in reached or not bool((depth([reached[fill.target], region])[1] == 2).any()):
                continue
            p.segments, p.fills = [], []
            p.fallback_reason = (
                f"loader writes outside a plain copy: {fill.op} writes parameter {fill.target} (elements "
                "that checkpoint elements reach)"
            )
            break


def unreached(
    placements: Mapping[str, TensorPlacement],
    destinations: Mapping[str, torch.Tensor],
    replayed: Iterable[str] = (),
) -> dict[str, str]:
    """{destination: why} for each destination the segments and fills reach fewer elements of than it holds
    (but those a fallback's replay writes). Why: a probe that misses a loader's writes (as after vLLM's
    `reload_weights`) turns a real tensor into an ignored one, whose deltas would be dropped silently."""
    reached: Counter[str] = Counter()
    for part in (part for p in placements.values() for part in (*p.segments, *p.fills)):
        reached[part.target] += math.prod(part.sizes)
    skip = set(replayed)
    return {
        name: (
            f"the map reaches {reached[name]} of its {t.numel()} elements: some loader write was not "
            "seen at startup, so deltas to the tensors behind it would be dropped"
        )
        for name, t in destinations.items()
        if name not in skip and reached[name] < t.numel()
    }


def derived_params(keys: Iterable[tuple[str, str]]) -> set[str]:
    """Full names of the parameters among derived tensors ((unit, key) as `derived.DerivedTensor` holds
    them): no checkpoint element reaches them, and `derived` keeps them exact."""
    out = set()
    for unit, key in keys:
        path, _, leaf = key.rpartition(".")
        if leaf.startswith("param:"):
            out.add(".".join(p for p in (unit, path, leaf.removeprefix("param:")) if p))
    return out
