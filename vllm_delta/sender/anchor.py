"""An anchor's values, read a piece at a time while it is encoded, never staged whole.

Why: an anchor re-sends every element of a rank's shards. Staging a copy of them at capture, with
an int64 position each, cost about 10 B per bf16 element of pinned host memory (52-63 GB per GPU
at 355B). The captured version is already held: it is the snapshot (version S, which nothing
writes until the engines answered this capture) with the capture's changes, staged anyway
(O(changed)), written over it. So the publisher reads the snapshot piece by piece in HF position
order, patches each piece with the changes that fall inside it, and hands the pieces to
`FlushBuilder.add_dense`, whose flushes carry implicit positions: an anchor holds about a flush,
whatever the model size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import torch

Run = tuple[int, int, int]  # (local flat start, HF flat start, length)


@dataclass(eq=False)
class Anchor:
    """One shard's captured values, as pieces in HF position order (see the module docstring)."""

    placement: tuple  # Shard/Segments.describe(): (name, full_shape, dim or None, spans or runs)
    snapshot: torch.Tensor  # flat, local order, version S
    positions: torch.Tensor  # sorted HF flat positions covering every element that differs from it
    values: torch.Tensor  # the captured values there
    staging: torch.device  # where pieces are made (the host)
    ready: object | None = None  # a CUDA event after which the snapshot may be read

    def runs(self) -> Iterator[Run]:
        """The shard's elements as runs in HF order, adjacent ones merged (O(1) memory)."""
        prev: list[int] | None = None
        for local, hf, n in _runs(self.placement):
            if prev is not None and prev[0] + prev[2] == local and prev[1] + prev[2] == hf:
                prev[2] += n
                continue
            if prev is not None:
                yield tuple(prev)
            prev = [local, hf, n]
        if prev is not None:
            yield tuple(prev)

    def pieces(self, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """`(HF start, values)` of at most `max_bytes` each, a fresh staging tensor per piece."""
        m = max(1, max_bytes // self.snapshot.element_size())
        stream = None
        if self.snapshot.device.type == "cuda":  # copy beside the trainer's kernels, not behind them
            stream = torch.cuda.Stream(device=self.snapshot.device)
            if self.ready is not None:
                stream.wait_event(self.ready)
        for local, hf, n in self.runs():
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
        lo, hi = torch.searchsorted(
            self.positions, torch.tensor([hf, hf + k], device=self.positions.device)
        ).tolist()
        if hi > lo:  # the capture's changes inside this piece
            piece[(self.positions[lo:hi] - hf).to(piece.device)] = self.values[lo:hi].to(piece.device)
        return piece


def _runs(placement: tuple) -> Iterator[Run]:
    """Runs of a placement in HF order: flat runs (`Segments`, dim None) or slices of one dim (`Shard`)."""
    _, full, dim, spans = placement
    starts = list(accumulate((n for _, n in spans), initial=0))  # each span's local start, then the total
    if dim is None:
        yield from sorted(((loc, hf, n) for loc, (hf, n) in zip(starts, spans)), key=lambda r: r[1])
        return
    if not full:  # a scalar
        yield 0, 0, 1
        return
    inner, outer = math.prod(full[dim + 1 :]), math.prod(full[:dim])
    local_len = starts[-1]
    ordered = sorted(zip(spans, starts))  # along `dim` in HF order, with each span's local offset
    for o in range(outer):
        for (a, n), loc in ordered:
            yield (o * local_len + loc) * inner, (o * full[dim] + a) * inner, n * inner
