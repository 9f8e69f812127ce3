"""A rank's part of an HF tensor, and where its elements sit in the whole one.

Why: a TP/EP/FSDP trainer holds slices of each weight. Gathering whole tensors before a diff is
exactly the traffic delta sync exists to avoid, so each rank diffs its own slice and maps the
changed local positions to flat positions of the full HF tensor. The map is affine per span:
the local tensor is the concatenation, along one dim, of a few slices of the full tensor (a TP row
or column slice is one span; a rank's query groups of a fused qkv, or an EP rank's experts, are
several). No per-element table is kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from vllm_delta.sender.segments import shifted


@dataclass(frozen=True, eq=False)
class Shard:
    """`tensor` (any device) is the concatenation along `dim` of `full.narrow(dim, start, length)`
    for each `(start, length)` in `spans`, where `full` is the HF tensor `name` of `full_shape`."""

    name: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int = 0
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        full = tuple(int(n) for n in self.full_shape)
        object.__setattr__(self, "full_shape", full)
        spans = tuple((int(a), int(n)) for a, n in self.spans) or ((0, full[self.dim] if full else 1),)
        object.__setattr__(self, "spans", spans)
        local_len = sum(n for _, n in spans)
        expected = full[: self.dim] + (local_len,) + full[self.dim + 1 :] if full else ()
        if tuple(self.tensor.shape) != expected:
            raise ValueError(
                f"{self.name}: local shape {list(self.tensor.shape)} is not {list(full)} "
                f"with dim {self.dim} cut to {local_len}"
            )
        ends = sorted(spans)
        if any(a < 0 or n < 0 or (full and a + n > full[self.dim]) for a, n in spans) or any(
            a1 + n1 > a2 for (a1, n1), (a2, _) in zip(ends, ends[1:])
        ):
            raise ValueError(
                f"{self.name}: spans {list(spans)} overlap or leave dim {self.dim} of {list(full)}"
            )

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> Shard:
        return cls(name, tensor, tuple(tensor.shape))

    @classmethod
    def narrow(
        cls, name: str, tensor: torch.Tensor, full_shape: Sequence[int], dim: int, start: int
    ) -> Shard:
        """`tensor` is `full.narrow(dim, start, tensor.shape[dim])`: a TP row or column slice."""
        return cls(name, tensor, tuple(full_shape), dim, ((start, tensor.shape[dim]),))

    @classmethod
    def pieces(
        cls,
        name: str,
        tensor: torch.Tensor,
        full_shape: Sequence[int],
        dim: int,
        spans: Iterable[tuple[int, int]],
    ) -> Shard:
        """Several slices of one dim, concatenated (e.g. interleaved query groups)."""
        return cls(name, tensor, tuple(full_shape), dim, tuple(spans))

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == self.full_shape

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """HF flat positions of local flat positions (int64, computed on their device)."""
        if self.is_whole:
            return local
        inner = math.prod(self.full_shape[self.dim + 1 :])
        local_len = sum(n for _, n in self.spans)
        outer_idx = torch.div(local, local_len * inner, rounding_mode="floor")
        rest = local - outer_idx * (local_len * inner)  # position inside one outer row, in local units
        row = torch.div(rest, inner, rounding_mode="floor")  # index along `dim`, local
        along = shifted(row, self.spans)
        return outer_idx * (self.full_shape[self.dim] * inner) + along * inner + (rest - row * inner)

    def global_index(self) -> torch.Tensor:
        """Every local element's HF flat position (O(shard) memory: for seeding and checks only)."""
        return self.to_global(torch.arange(self.tensor.numel(), device=self.tensor.device))

    def with_tensor(self, tensor: torch.Tensor) -> Shard:
        """The same placement over other values (e.g. the checkpoint's, to seed a snapshot)."""
        return Shard(self.name, tensor, self.full_shape, self.dim, self.spans)

    def describe(self) -> tuple[str, tuple[int, ...], int, tuple[tuple[int, int], ...]]:
        """The placement as plain data (what ranks exchange to check disjointness)."""
        return self.name, self.full_shape, self.dim, self.spans


def check_disjoint(
    placements: Iterable[tuple[str, tuple[int, ...], int, tuple[tuple[int, int], ...]]],
) -> dict[str, float]:
    """Raise if two placements of one tensor overlap; return each tensor's covered fraction.

    Placements are compared span by span (no element tables): two spans on the same dim overlap
    iff their ranges do; spans on different dims of one tensor always share elements. Dim `None`
    means flat runs (`Segments`); a tensor with any such part is compared flat.
    """
    by_name: dict[str, list[tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]]] = {}
    for name, shape, dim, spans in placements:
        by_name.setdefault(name, []).append((tuple(shape), dim, tuple(spans)))
    coverage = {}
    for name, parts in by_name.items():
        shapes = {p[0] for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{name}: ranks disagree on the full shape: {sorted(shapes)}")
        (shape,) = shapes
        if any(p[1] is None for p in parts):  # flat runs (segments.py): compare everything flat
            flat = (math.prod(shape),)
            parts = [(flat, 0, p[2] if p[1] is None else flat_runs(shape, p[1], p[2])) for p in parts]
            shape = flat
        if len(parts) > 1 and len({p[1] for p in parts}) != 1:
            raise ValueError(f"{name}: ranks cut it along different dims; they would overlap")
        dim = parts[0][1]
        spans = sorted(s for p in parts for s in p[2])
        for (a1, n1), (a2, n2) in zip(spans, spans[1:]):
            if a1 + n1 > a2 and n1 and n2:
                raise ValueError(
                    f"{name}: two ranks both hold dim {dim} indices {a2}..{min(a1 + n1, a2 + n2) - 1}"
                )
        coverage[name] = sum(n for _, n in spans) / shape[dim] if shape else 1.0
    return coverage


def flat_runs(
    shape: tuple[int, ...], dim: int, spans: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...]:
    """A `Shard` placement as flat (HF start, length) runs covering its elements in local order."""
    if not shape:
        return ((0, 1),)
    inner, outer = math.prod(shape[dim + 1 :]), math.prod(shape[:dim])
    return tuple((o * shape[dim] * inner + a * inner, n * inner) for o in range(outer) for a, n in spans if n)
