"""Counted-once additive digests of what one rank holds, and their check across ranks. Why counted once:
under TP several ranks hold some elements (norms, replicated kv heads), so each sums those no lower rank
holds, and the door adds the ranks' partials against the manifest's digest."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_delta.engine.placement import Segment, TensorPlacement, depth, grid, runs, union
from vllm_delta.wire.additive import combine
from vllm_delta.wire.errors import DeltaError, IntegrityError

# (src_offset, sizes, src_strides): the checkpoint ids one segment holds.
Lattice = tuple[int, tuple[int, ...], tuple[int, ...]]


def lattice(seg: Segment) -> Lattice:
    return seg.src_offset, seg.sizes, seg.src_strides


def contains(lat: Lattice, positions: torch.Tensor) -> torch.Tensor:
    """Whether each flat checkpoint position is one of the lattice's ids (dims by decreasing stride, each
    above the span of the smaller ones, so the greedy decomposition is the only one)."""
    offset, sizes, strides = lat
    rest = positions.to(torch.int64) - offset
    inside = rest >= 0
    for n, s in zip(sizes, strides):
        i = torch.div(rest, s, rounding_mode="floor")
        inside &= (i >= 0) & (i < n)
        rest = rest - i * s
    return inside & (rest == 0)


def lattice_parts(lat: Lattice | Sequence[Any]) -> Lattice:
    offset, sizes, strides = lat
    if type(sizes) is tuple and type(strides) is tuple and type(offset) is int:
        return lat if type(lat) is tuple else (offset, sizes, strides)  # already plain (startup: 46k x ranks)
    return int(offset), tuple(int(n) for n in sizes), tuple(int(s) for s in strides)


def coverage(placements: Mapping[str, TensorPlacement]) -> dict[str, list[Lattice]]:
    """This rank's lattices per checkpoint tensor (plain data, for the route to hand to peers)."""
    return {name: [lattice(s) for s in p.segments] for name, p in placements.items() if p.segments}


class CoverageError(DeltaError):
    """The ranks together do not hold some checkpoint tensor exactly (found at startup)."""

    http_status = 500


def refuse_uncovered(report: Mapping[str, Any] | None) -> None:
    """Raise CoverageError naming the first tensor the startup coverage check found wrong."""
    if report is not None and not report["ok"]:
        name, why = next(iter(report["errors"].items()))
        raise CoverageError(f"placement coverage check failed at startup: {why}", param=name)


def _held(lats: Sequence[Lattice]) -> torch.Tensor:
    """One rank's ids of a tensor as merged [start, end) runs (held twice here, held once)."""
    return union([runs(*lat) for lat in lats])


def _coverage_error(name: str, numel: int, per_rank: Sequence[Sequence[Lattice]]) -> str | None:
    """Why the ranks' lattices do not hold every element of a tensor the same number of times."""
    ends = torch.tensor([[0, 0], [numel, numel]])  # empty runs: breakpoints at both ends of the tensor
    points, level = depth([ends, *(_held(lats) for lats in per_rank if lats)])
    pieces = level[:-1]
    if bool((pieces == 0).any()):
        i = int(torch.nonzero(pieces == 0)[0])
        return f"{name}: elements [{int(points[i])}, {int(points[i + 1])}) are held by no rank"
    if int(pieces.min()) != int(pieces.max()):
        i = int(torch.nonzero(pieces != pieces[0])[0])
        return (
            f"{name}: elements [{int(points[i])}, {int(points[i + 1])}) are held by {int(pieces[i])} "
            f"ranks, elements from 0 by {int(pieces[0])}: ranks overlap"
        )
    return None


_NAME = "\x00tensor\x00"  # the name a memoised coverage verdict is computed under


def check_coverage(
    replies: Sequence[Mapping[str, Any]], shapes: Mapping[str, Sequence[int]]
) -> dict[str, Any]:
    """Whether every element of every checkpoint tensor is held by the same number of ranks (only all
    ranks together tell a tensor another rank holds from one the probe missed): {"ok", "errors": {name:
    why}, "ignored": [names no rank's loader read]}. Verdicts are memoised by size and lattices."""
    errors: dict[str, str] = {}
    ignored = []
    fallback = {n for r in replies for n in r.get("fallback") or ()}
    unread = [set(r.get("unread") or ()) for r in replies]
    verdicts: dict[tuple, str | None] = {}
    for r in replies:  # a rank whose map disagrees with vLLM's loader (engine/map_check.py)
        for target, why in (r.get("map_errors") or {}).items():
            errors.setdefault(target, f"rank {r.get('rank')}: {why}")
    for name, shape in shapes.items():
        if name in fallback:
            continue
        numel = torch.Size(shape).numel()
        per_rank = [[lattice_parts(lat) for lat in (r["coverage"].get(name) or ())] for r in replies]
        if not any(per_rank):
            if all(name in u for u in unread):
                ignored.append(name)
            else:
                errors[name] = (
                    f"{name}: no rank holds any element (the loader read it, the probe saw no copy)"
                )
            continue
        if not numel:
            continue
        key = (numel, tuple(tuple(sorted(lats)) for lats in per_rank))
        if key not in verdicts:
            verdicts[key] = _coverage_error(_NAME, numel, per_rank)
        if (why := verdicts[key]) is not None:
            errors[name] = why.replace(_NAME, name)
    return {"ok": not errors, "errors": errors, "ignored": sorted(ignored)}


def _share(mine: Sequence[Lattice], lower: Sequence[Lattice]) -> str:
    """ "all", "none" or "some": how much of what this rank holds no lower rank holds."""
    held = _held(mine)
    points, level = depth([held, _held(lower)])
    both = int((points[1:] - points[:-1])[level[:-1] == 2].sum())
    if both == 0:
        return "all"
    return "none" if both == int((held[:, 1] - held[:, 0]).sum()) else "some"


@dataclass(eq=False)  # one per handover: routing.py keeps routes while it `is` the same
class Ownership:
    """Which held elements this rank counts: those no lower rank holds, decided per tensor at startup
    (`share`: "all", "none", or "some" with a per-position mask): a mask costs ~0.4 us an entry."""

    lower: dict[str, list[Lattice]] = field(default_factory=dict)  # what lower ranks hold of a tensor
    shares: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_coverages(cls, coverages: Sequence[Mapping[str, list[Lattice]]], rank: int) -> Ownership:
        """From every rank's `coverage`, in rank order (memoised per structural class)."""
        mine = coverages[rank] if rank < len(coverages) else {}
        lower: dict[str, list[Lattice]] = {}
        for cov in coverages[:rank]:
            for name, lats in cov.items():
                if name in mine:
                    lower.setdefault(name, []).extend(lattice_parts(lat) for lat in lats)
        shares, memo = {}, {}
        for name, lats in lower.items():
            key = (tuple(sorted(lattice_parts(lat) for lat in mine[name])), tuple(sorted(lats)))
            if key not in memo:
                memo[key] = _share(*key)
            shares[name] = memo[key]
        return cls(
            {n: lats for n, lats in lower.items() if shares[n] != "all"},
            {n: v for n, v in shares.items() if v != "all"},
        )

    def share(self, name: str) -> str:
        return self.shares.get(name, "some" if self.lower.get(name) else "all")

    def counted(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        share = self.share(name)
        mask = torch.full(positions.shape, share != "none", dtype=torch.bool, device=positions.device)
        for lat in self.lower.get(name, ()) if share == "some" else ():
            mask &= ~contains(lat, positions)
        return mask


def segment_chunks(
    seg: Segment, flat: torch.Tensor, max_elements: int = 1 << 22
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(checkpoint positions, held values) of a segment, a block of rows at a time (bounded temporaries)."""
    if not seg.sizes:
        yield (torch.tensor([seg.src_offset], device=flat.device), flat[seg.dst_offset : seg.dst_offset + 1])
        return
    rows = max(1, max_elements // max(math.prod(seg.sizes[1:]), 1))
    for r0 in range(0, seg.sizes[0], rows):
        sizes = (min(rows, seg.sizes[0] - r0), *seg.sizes[1:])
        values = torch.as_strided(flat, sizes, seg.dst_strides, seg.dst_offset + r0 * seg.dst_strides[0])
        pos = grid(seg.src_offset + r0 * seg.src_strides[0], sizes, seg.src_strides, flat.device)
        yield pos.reshape(-1), values.reshape(-1)


def mismatches(replies: Sequence[Mapping[str, Any]]) -> tuple[int, list[tuple[str, str, str, str]]]:
    """The ranks' partial `digests` ({name: [pre, post]}) added per tensor, against rank 0's `expected`:
    (digests checked, [(name, "pre"|"post", got, want)])."""
    expected: Mapping[str, Sequence[str | None]] = replies[0].get("expected") or {}
    checked, bad = 0, []
    for name, wants in expected.items():
        for i, (which, want) in enumerate(zip(("pre", "post"), wants)):
            if want is None:
                continue
            parts = [r["digests"][name][i] for r in replies if (r.get("digests") or {}).get(name)]
            got = combine(*(p for p in parts if p))
            checked += 1
            if got != want:
                bad.append((name, which, got, want))
    return checked, bad


def check_partials(replies: Sequence[Mapping[str, Any]]) -> int:
    """`mismatches`, raising IntegrityError naming the first tensor that differs."""
    checked, bad = mismatches(replies)
    if bad:
        name, which, got, want = bad[0]
        raise IntegrityError(
            f"{which}-apply digest of the changed positions is {got}, the manifest says {want}"
            + (": this engine is not at the delta's base" if which == "pre" else ""),
            param=name,
        )
    return checked
