"""What a flush carries: a sender's `ParamChange`s, a receiver's `ParamDelta`s and `DeltaBatch`es."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import final

import torch

from .codecs import ulp_resolve_tensor


@dataclass(frozen=True, eq=False)
class ParamChange:
    """Sender side: the changes of one param (or one chunk of it). With `ranges` (sorted, disjoint
    `(start, length)` runs) and `positions` None, every position of the runs: written with implicit
    positions (an anchor re-sends whole shards; an int64 per element would be 4x its bf16 values)."""

    name: str
    shape: tuple[int, ...]
    positions: torch.Tensor | None  # int64, sorted, unique; None with `ranges`
    new_values: torch.Tensor  # the param's own dtype
    old_values: torch.Tensor | None = None  # needed by base-relative encodings
    ranges: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, eq=False, init=False)
class ParamDelta:
    """Receiver side: decoded, validated changes of one param (or one chunk of it). `values`: new values
    in `dtype`, or with `needs_base` signed-integer ULP steps of its width (`resolve` gives the values)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor
    values: torch.Tensor
    needs_base: bool
    # Entries in blocks left undecoded (not owned), first and last position counting those, (decoded,
    # indexed) blocks.
    skipped: int = 0
    bounds: tuple[int, int] | None = None
    blocks: tuple[int, int] = (0, 0)

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        positions: torch.Tensor,
        values: torch.Tensor,
        needs_base: bool,
        skipped: int = 0,
        bounds: tuple[int, int] | None = None,
        blocks: tuple[int, int] = (0, 0),
    ) -> None:
        # Not the dataclass's own: a frozen one sets each field with its own call (2.3 vs 0.8 us a delta).
        object.__setattr__(
            self,
            "__dict__",
            {
                "name": name,
                "shape": shape,
                "dtype": dtype,
                "positions": positions,
                "values": values,
                "needs_base": needs_base,
                "skipped": skipped,
                "bounds": bounds,
                "blocks": blocks,
            },
        )

    @property
    def count(self) -> int:
        return self.positions.numel()

    @property
    def total(self) -> int:
        """Entries of the chunk on the wire, decoded or skipped."""
        return self.positions.numel() + self.skipped  # not self.count: one call less a tensor in admit

    @property
    def first(self) -> int:
        return self.bounds[0] if self.bounds is not None else int(self.positions[0])

    @property
    def last(self) -> int:
        return self.bounds[1] if self.bounds is not None else int(self.positions[-1])

    def resolve(self, old: torch.Tensor | None = None) -> torch.Tensor:
        """New values at `positions`: exact integer ops on bit patterns, where `old` lives."""
        if not self.needs_base:
            return self.values
        if old is None or old.dtype != self.dtype or old.numel() != self.count:
            raise ValueError(f"{self.name}: resolve needs the {self.count} current {self.dtype} values")
        return ulp_resolve_tensor(old.detach(), self.values.to(old.device))

    def apply_(self, tensor: torch.Tensor) -> None:
        """Write the changes into a full tensor of `shape` in place."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype or not tensor.is_contiguous():
            raise ValueError(f"{self.name}: target must be contiguous {self.dtype}{list(self.shape)}")
        flat = tensor.view(-1)
        pos = self.positions.to(tensor.device)
        flat[pos] = self.resolve(flat[pos] if self.needs_base else None).to(tensor.device)


@final  # `type(item) is DeltaBatch` then tells it from a ParamDelta, for mypy too
@dataclass(eq=False, slots=True)
class DeltaBatch:
    """Receiver side: decoded, validated changes of a run of whole params of one flush, as columns:
    positions in one tensor (`sizes` each), values in one tensor per value type (`values[types[i]]`).

    Why: at 44k tensors of a few changes each, a `ParamDelta` a tensor and the checks on it were most
    of prepare's fixed cost. `deltas()` gives the same changes as `ParamDelta`s.
    """

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    positions: torch.Tensor
    values: dict[object, torch.Tensor]
    types: list
    sizes: list[int]
    needs_base: bool
    counts: list[int]  # entries on the wire, per param
    skipped: list[int]
    first: list[int]
    last: list[int]
    nblocks: list[tuple[int, int]]  # per param: (decoded, indexed) blocks
    nbytes: int  # of positions and values
    total: int = field(init=False)  # entries on the wire, decoded or skipped (`ParamDelta.total`, summed)
    blocks: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.total = sum(self.counts)
        decoded, indexed = zip(*self.nblocks) if self.nblocks else ((), ())
        self.blocks = (sum(decoded), sum(indexed))

    def __len__(self) -> int:
        return len(self.names)

    def deltas(self) -> Iterator[ParamDelta]:
        """The same changes, a `ParamDelta` (of views) a param."""
        positions = self.positions.split(self.sizes)
        values = {t: v.split(self.sizes) for t, v in self.values.items()}
        for i, name in enumerate(self.names):
            yield ParamDelta(
                name,
                self.shapes[i],
                self.dtypes[i],
                positions[i],
                values[self.types[i]][i],
                self.needs_base,
                self.skipped[i],
                (self.first[i], self.last[i]),
                self.nblocks[i],
            )
