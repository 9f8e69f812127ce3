"""A rank's part of an HF tensor, and where its elements sit in the whole one. Why: gathering whole tensors
is the traffic delta sync avoids, so each rank diffs its own part and maps changed local positions to HF
flat positions, affinely per span or run (no element tables)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

Span = tuple[int, int]  # (start, length)
Runs = tuple[Span, ...]
Placement = tuple[str, tuple[int, ...], int | None, Runs]  # name, full shape, dim (None: flat runs), spans


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
        if _bad(spans, full[self.dim] if full else None, 0):
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
        cls, name: str, tensor: torch.Tensor, full_shape: Sequence[int], dim: int, spans: Iterable[Span]
    ) -> Shard:
        """Several slices of one dim, concatenated (e.g. interleaved query groups)."""
        return cls(name, tensor, tuple(full_shape), dim, tuple(spans))

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == self.full_shape

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

    def describe(self) -> Placement:
        """The placement as plain data (what ranks exchange to check disjointness)."""
        return self.name, self.full_shape, self.dim, self.spans


@dataclass(frozen=True, eq=False)
class Segments:
    """`tensor.reshape(-1)[k]` is `full.reshape(-1)[to_global(k)]`: runs `(hf_start, length)` cover the
    local elements in order. For layouts that are no slices of one dim (a Megatron rank's fused qkv rows,
    `[gate_r; up_r]`, a padded vocab shard); `describe()` gives dim None (flat)."""

    name: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        full = tuple(int(n) for n in self.full_shape)
        runs = tuple((int(a), int(n)) for a, n in self.runs)
        object.__setattr__(self, "full_shape", full)
        object.__setattr__(self, "runs", runs)
        if sum(n for _, n in runs) != self.tensor.numel():
            raise ValueError(
                f"{self.name}: runs cover {sum(n for _, n in runs)} elements, the tensor has "
                f"{self.tensor.numel()}"
            )
        if _bad(runs, math.prod(full), 1):
            raise ValueError(f"{self.name}: runs overlap, are empty or leave the {list(full)} tensor")

    @property
    def is_whole(self) -> bool:
        return self.runs == ((0, math.prod(self.full_shape)),) and tuple(self.tensor.shape) == self.full_shape

    global_index = Shard.global_index

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        return shifted(local, self.runs)

    def with_tensor(self, tensor: torch.Tensor) -> Segments:
        return Segments(self.name, tensor, self.full_shape, self.runs)

    def describe(self) -> Placement:
        return self.name, self.full_shape, None, self.runs


def _bad(runs: Runs, end: int | None, min_len: int) -> bool:
    """Some run starts below 0, is shorter than `min_len`, passes `end`, or overlaps another."""
    ends = sorted(runs)
    return any(a < 0 or n < min_len or (end is not None and a + n > end) for a, n in runs) or any(
        a1 + n1 > a2 for (a1, n1), (a2, _) in zip(ends, ends[1:])
    )


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


def check_disjoint(placements: Iterable[Placement]) -> dict[str, float]:
    """Each tensor's covered fraction; raises if two placements of one tensor overlap (across dims always)."""
    by_name: dict[str, list[tuple[tuple[int, ...], int | None, Runs]]] = {}
    for name, shape, dim, spans in placements:
        by_name.setdefault(name, []).append((tuple(shape), dim, tuple(spans)))
    coverage = {}
    for name, parts in by_name.items():
        shapes = {p[0] for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{name}: ranks disagree on the full shape: {sorted(shapes)}")
        (shape,) = shapes
        if any(p[1] is None for p in parts):  # flat runs (Segments): compare everything flat
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


def flat_runs(shape: tuple[int, ...], dim: int, spans: Runs) -> Runs:
    """A `Shard` placement as flat (HF start, length) runs covering its elements in local order."""
    if not shape:
        return ((0, 1),)
    inner, outer = math.prod(shape[dim + 1 :]), math.prod(shape[:dim])
    return tuple((o * shape[dim] * inner + a * inner, n * inner) for o in range(outer) for a, n in spans if n)


def strided(runs: Sequence[tuple[int, int]]) -> bool:
    """One run, or equal runs at a constant positive stride: what one strided view covers."""
    steps = {b[0] - a[0] for a, b in zip(runs, runs[1:])}
    return len(runs) == 1 or (len({n for _, n in runs}) == 1 and len(steps) == 1 and runs[1][0] > runs[0][0])


def strided_view(flat: torch.Tensor, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The view of 1-d `flat` over `strided` runs (a rank's q rows across its query groups: 2-d)."""
    a, n = runs[0]
    if len(runs) == 1:
        return flat[a : a + n]
    return flat.as_strided((len(runs), n), (runs[1][0] - a, 1), flat.storage_offset() + a)
