"""Counted-once additive digests of what one rank holds, and their check across ranks.

Why counted once: the manifest's `pre_digest` / `post_digest` / `digest` sum every checkpoint
element of a tensor exactly once (wire/additive.py), but under tensor parallelism several ranks
hold the same element (norms, replicated weights, kv heads replicated past the kv-head count).
Each rank therefore sums only the elements that no lower rank holds, learned once from the
source lattices of every rank's placement segments; the route adds the ranks' partials and
compares with the manifest. Everything here is torch on the weights' own device; only the two
64-bit lane sums per tensor leave it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from vllm_delta.engine.placement import Segment, TensorPlacement
from vllm_delta.wire.additive import combine
from vllm_delta.wire.errors import IntegrityError

# (src_offset, sizes, src_strides): the checkpoint ids one segment holds.
Lattice = tuple[int, tuple[int, ...], tuple[int, ...]]


def lattice(seg: Segment) -> Lattice:
    return seg.src_offset, seg.sizes, seg.src_strides


def contains(lat: Lattice, positions: torch.Tensor) -> torch.Tensor:
    """Whether each flat checkpoint position is one of the lattice's ids (any order, any device).

    Dims come by decreasing stride, each stride above the span of the smaller ones, so the
    greedy decomposition is the only one.
    """
    offset, sizes, strides = lattice_parts(lat)
    rest = positions.to(torch.int64) - offset
    inside = rest >= 0
    for n, s in zip(sizes, strides):
        i = torch.div(rest, s, rounding_mode="floor")
        inside &= (i >= 0) & (i < n)
        rest = rest - i * s
    return inside & (rest == 0)


def lattice_parts(lat: Lattice | Sequence[Any]) -> Lattice:
    offset, sizes, strides = lat
    return int(offset), tuple(int(n) for n in sizes), tuple(int(s) for s in strides)


def coverage(placements: Mapping[str, TensorPlacement]) -> dict[str, list[Lattice]]:
    """This rank's lattices per checkpoint tensor (plain data, for the route to hand to peers)."""
    return {name: [lattice(s) for s in p.segments] for name, p in placements.items() if p.segments}


class Ownership:
    """Which held elements this rank counts: those no lower rank holds."""

    def __init__(self, lower: Mapping[str, list[Lattice]] | None = None) -> None:
        self.lower = {name: [lattice_parts(lat) for lat in lats] for name, lats in (lower or {}).items()}

    @classmethod
    def from_coverages(cls, coverages: Sequence[Mapping[str, list[Lattice]]], rank: int) -> Ownership:
        """From every rank's `coverage`, in rank order: the lattices of ranks below `rank`."""
        lower: dict[str, list[Lattice]] = {}
        for cov in coverages[:rank]:
            for name, lats in cov.items():
                lower.setdefault(name, []).extend(lats)
        return cls(lower)

    def counted(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        for lat in self.lower.get(name, ()):
            mask &= ~contains(lat, positions)
        return mask


def segment_chunks(seg: Segment, flat: torch.Tensor,
                   max_elements: int = 1 << 22) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(checkpoint positions, held values) of a segment, a block of leading rows at a time.

    Why blocks: a full verify must not allocate int64 temporaries the size of the embedding.
    """
    if not seg.sizes:
        yield (torch.tensor([seg.src_offset], device=flat.device),
               flat[seg.dst_offset:seg.dst_offset + 1])
        return
    inner = 1
    for n in seg.sizes[1:]:
        inner *= n
    rows = max(1, max_elements // max(inner, 1))
    for r0 in range(0, seg.sizes[0], rows):
        sizes = (min(rows, seg.sizes[0] - r0), *seg.sizes[1:])
        values = torch.as_strided(flat, sizes, seg.dst_strides, seg.dst_offset + r0 * seg.dst_strides[0])
        pos = torch.tensor(seg.src_offset + r0 * seg.src_strides[0], device=flat.device)
        for n, s in zip(sizes, seg.src_strides):
            pos = pos.unsqueeze(-1) + torch.arange(n, device=flat.device) * s
        yield pos.reshape(-1), values.reshape(-1)


def mismatches(replies: Sequence[Mapping[str, Any]]) -> tuple[int, list[tuple[str, str, str, str]]]:
    """Add the ranks' partial digests per tensor and compare with rank 0's expectations.

    Each reply has `digests`: {name: [pre, post]} (hex or None); rank 0's also has `expected` in
    the same shape, from the manifest. Returns (digests checked, [(name, "pre"|"post", got, want)]).
    """
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
        raise IntegrityError(f"{which}-apply digest of the changed positions is {got}, the manifest says {want}"
                             + (": this engine is not at the delta's base" if which == "pre" else ""), param=name)
    return checked
