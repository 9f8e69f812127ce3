"""A rank's elements of an HF tensor as affine runs of flat positions.

Why: some trainer layouts are not "slices of one dim" (`Shard`). A Megatron rank's fused
`linear_qkv` rows map to q, k and v in interleaved query groups, a `linear_fc1` shard is
`[gate_r; up_r]`, and a padded vocab shard ends in rows with no HF position. Each of these is,
per HF tensor, a few runs where consecutive local elements land on consecutive HF flat
positions. `Segments` carries exactly that: the local tensor (the rank's elements of this HF
tensor, in local order, usually a view of the trainer's parameter) and, per run, its HF flat
start and length. It implements the placement protocol the producer uses (`name`, `tensor`,
`full_shape`, `is_whole`, `to_global`, `global_index`, `describe`); `describe()` uses dim
`None` (flat), which `check_disjoint` understands.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True, eq=False)
class Segments:
    """`tensor.reshape(-1)[k]` is `full.reshape(-1)[to_global(k)]`: runs `(hf_start, length)`
    cover the local elements in order, each mapping consecutive elements to consecutive HF ones."""

    name: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        full = tuple(int(n) for n in self.full_shape)
        runs = tuple((int(a), int(n)) for a, n in self.runs)
        object.__setattr__(self, "full_shape", full)
        object.__setattr__(self, "runs", runs)
        total = math.prod(full)
        if sum(n for _, n in runs) != self.tensor.numel():
            raise ValueError(
                f"{self.name}: runs cover {sum(n for _, n in runs)} elements, the tensor has "
                f"{self.tensor.numel()}"
            )
        ends = sorted(runs)
        if any(a < 0 or n <= 0 or a + n > total for a, n in runs) or any(
            a1 + n1 > a2 for (a1, n1), (a2, _) in zip(ends, ends[1:])
        ):
            raise ValueError(f"{self.name}: runs overlap, are empty or leave the {list(full)} tensor")

    @classmethod
    def from_positions(
        cls, name: str, tensor: torch.Tensor, full_shape: Sequence[int], hf_positions: torch.Tensor
    ) -> Segments:
        """Compress a per-element map (local order) into runs; O(map) memory, transient."""
        return cls(name, tensor, tuple(full_shape), runs_of(hf_positions))

    @property
    def is_whole(self) -> bool:
        return (
            len(self.runs) == 1
            and self.runs[0] == (0, math.prod(self.full_shape))
            and tuple(self.tensor.shape) == self.full_shape
        )

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """HF flat positions of local flat positions (int64, on their device)."""
        return shifted(local, self.runs)

    def global_index(self) -> torch.Tensor:
        """Every local element's HF flat position (O(shard) memory: seeding and checks only)."""
        return self.to_global(torch.arange(self.tensor.numel(), device=self.tensor.device))

    def with_tensor(self, tensor: torch.Tensor) -> Segments:
        """The same placement over other values (e.g. the checkpoint's, to seed a snapshot)."""
        return Segments(self.name, tensor, self.full_shape, self.runs)

    def describe(self) -> tuple[str, tuple[int, ...], None, tuple[tuple[int, int], ...]]:
        return self.name, self.full_shape, None, self.runs


def shifted(local: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`local` (indices into the runs `(start, length)` laid end to end) mapped into each run's start."""
    if len(runs) == 1:
        return local + runs[0][0]
    ends = list(accumulate(n for _, n in runs))
    bounds = torch.tensor(ends[:-1], dtype=local.dtype, device=local.device)
    shifts = torch.tensor(
        [a - e + n for (a, n), e in zip(runs, ends)], dtype=local.dtype, device=local.device
    )
    return local + shifts[torch.bucketize(local, bounds, right=True)]


def runs_of(positions: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """`(start, length)` runs of consecutive values, in order (O(len) transient memory)."""
    pos = positions.reshape(-1).to(torch.int64).cpu()
    if pos.numel() == 0:
        return ()
    breaks = torch.nonzero(pos[1:] - pos[:-1] != 1).reshape(-1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lengths = torch.diff(torch.cat([starts, torch.tensor([pos.numel()])]))
    return tuple(zip(pos[starts].tolist(), lengths.tolist()))
