"""What a flush carries: a sender's `ParamChange`s, a receiver's `ParamDelta`s and `DeltaBatch`es."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import final

import torch

from .codecs import ulp_resolve_tensor


@dataclass(frozen=True, eq=False)
class ParamChange:
    """Sender side: the changes of one param (or one chunk of it).

    With `ranges` (sorted, disjoint `(start, length)` runs) and `positions` None, the changes are
    every position of the runs, in order: written with implicit positions (width 0), no position
    bytes. Why: an anchor re-sends whole shards, and an int64 per element would be 4x its bf16 values.
    """

    name: str
    shape: tuple[int, ...]
    positions: torch.Tensor | None  # int64, sorted, unique; None with `ranges`
    new_values: torch.Tensor  # the param's own dtype
    old_values: torch.Tensor | None = None  # needed by base-relative encodings
    ranges: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, eq=False, init=False)
class ParamDelta:
    """Receiver side: decoded, validated changes of one param (or one chunk of it).

    `values` holds the new values in `dtype` for overwrite encodings. For base-relative encodings
    (`needs_base`) it holds signed-integer ULP steps of the same width; call `resolve` with the
    receiver's current values at `positions` to get the new values.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor
    values: torch.Tensor
    needs_base: bool
    # Entries of this chunk in blocks left undecoded (outside the receiver's owned ranges), the
    # chunk's first and last position counting those, and (decoded, indexed) blocks.
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
        # Why not the dataclass's own __init__: a frozen one sets each field with its own
        # object.__setattr__ call, 2.3 us an object; one __dict__ for all is 0.8 us, and a flush of
        # a production tensor count makes tens of thousands. Still frozen: assignment raises.
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
        """New values at `positions`: exact integer ops on bit patterns, where `old` lives.

        Only the steps (the delta's own payload) move to `old`'s device; the weights never leave it.
        """
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
    """Receiver side: decoded, validated changes of a run of whole params of one flush, as columns.

    Why: at a production tensor count (44k tensors of a few changes each) a `ParamDelta` a tensor,
    and the per-tensor checks and bookkeeping done on it, were most of prepare's fixed cost. The
    batched decoder (wire/batch.py) gives a run of params as one object instead: every entry's
    positions in one tensor (param after param, `sizes` each), the values in one tensor per value
    type (`values[types[i]]`: the same entries, viewed in param i's dtype, or its signed steps), and
    lists over the params. The reader checks it a run at a time (`DeltaDecoder.admit`), the engine
    stages it so (`DeltaApplier.stage`). Only readers that ask for it get one
    (`iter_delta(batches=True)`); `deltas()` gives the same changes as `ParamDelta`s.
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
