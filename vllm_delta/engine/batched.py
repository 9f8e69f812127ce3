"""One pass per (batch, destination): locate every checkpoint tensor feeding a destination at once.

Why: a fused MoE parameter is fed by hundreds of expert tensors, and a per-tensor loop cost ~1.5 ms
a tensor (70 s at 46k). Here a destination's entries go through a constant number of tensor ops
(per-piece affine maps gathered by piece id, one ownership mask, one compaction). Off the CPU the
ownership filter stays on the host, so only owned entries cross and nothing syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, sub

import torch

from vllm_delta.engine.placement import Segment

# A padded dimension (and a stride-0 one) divides by this, so its index is 0 for every id in range.
_NO_DIM = 1 << 62


@dataclass(frozen=True)
class Landing:
    """What locate asks of a (tensor, segment) pair, worked out once per placement (`Landing.of`)."""

    whole: bool  # the segment holds every id of its tensor: every decoded entry lands
    dense: bool  # it holds every id from src_offset to src_last (a range)
    shifted: bool  # dense, with the same strides on both sides: offset = position + shift

    @classmethod
    def of(cls, seg: Segment, numel: int) -> Landing:
        dense = seg.src_dense
        return cls(dense and seg.src_offset == 0 and seg.numel == numel, dense, dense and _same_strides(seg))


@dataclass(slots=True)  # slotted: one is made per (tensor, segment) every sync
class Piece:
    """The decoded entries of one checkpoint tensor (or a chunk of it) and one segment it lands through."""

    slot: int  # the tensor's row in the batch's digest sums
    positions: torch.Tensor | None  # sorted flat ids in the checkpoint tensor (None: `locate`'s `entries`)
    values: torch.Tensor | None
    seg: Segment
    numel: int  # elements of the checkpoint tensor
    landing: Landing | None = None  # `Landing.of(seg, numel)`, when the caller keeps it


class Known:
    """What `locate` works out of a list of pieces alone (their kinds, per-piece numbers, host tables),
    kept by a caller whose pieces do not change between syncs (a decoded batch's `routing.Plan`)."""

    __slots__ = ("kinds", "numbers", "tables")

    def __init__(self) -> None:
        self.kinds: Landing | None = None
        self.numbers: dict[str, list[int]] = {}
        self.tables: dict[str, torch.Tensor] = {}  # per-piece numbers that differ, as host int64


@dataclass
class Located:
    """Every entry of a destination's pieces this rank writes, in piece order."""

    positions: torch.Tensor  # checkpoint flat ids: the digests' keys
    offsets: torch.Tensor  # destination storage offsets
    values: torch.Tensor
    slots: torch.Tensor | int  # each entry's tensor row (an int: all the same)
    keep: torch.Tensor | None = None  # with `locate(defer=True)`: the entries this rank owns, for `compact`


def _kinds(pieces: list[Piece]) -> Landing:
    """What holds for every piece (each piece's `Landing` kept by the caller or made here)."""
    landings = list(map(_LANDING, pieces))
    if None in landings:
        landings = [p.landing or Landing.of(p.seg, p.numel) for p in pieces]
    return Landing(all(map(_WHOLE, landings)), all(map(_DENSE, landings)), all(map(_SHIFTED, landings)))


_LANDING, _WHOLE, _DENSE, _SHIFTED = (attrgetter(k) for k in ("landing", "whole", "dense", "shifted"))


def _same_strides(seg: Segment) -> bool:
    """Source and destination strides agree on every dim that has more than one index."""
    return all(n == 1 or a == b for n, a, b in zip(seg.sizes, seg.src_strides, seg.dst_strides))


# Tests set this to take the device path on the CPU (it is otherwise taken for any non-CPU destination).
FORCE_DEVICE_PATH = False


def on_device(device: torch.device) -> bool:
    """Whether a destination on `device` is located there (`locate(pieces, device)`), not on the host."""
    return device.type != "cpu" or FORCE_DEVICE_PATH


def locate(
    pieces: list[Piece],
    device: torch.device | None = None,
    *,
    defer: bool = False,
    there: bool | None = None,
    entries: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None,
    known: Known | None = None,
) -> Located:
    """Destination offsets of all pieces' entries, in a constant number of ops.

    `device` None: everything runs where the positions are. Else the host keeps only the owned entries
    (no device sync), which cross once with one table of the per-piece numbers that differ; positions
    decoded on `device` (`there`) are masked there, the mask left in `keep` with `defer` (`compact`).
    `entries`: the pieces' entries already concatenated (a plan's). `known`: an earlier locate's.
    """
    if entries is None:
        counts = [p.positions.numel() for p in pieces]
        positions = cat([p.positions for p in pieces]).to(torch.int64)
        values = cat([p.values for p in pieces])
    else:
        positions, values, counts = entries
        positions = positions.to(torch.int64)
    kinds = known.kinds if known is not None and known.kinds is not None else _kinds(pieces)
    if known is not None:
        known.kinds = kinds
    if there is None:
        there = device is not None and positions.device == device and values.device == device
    if device is not None and there:
        column = _Columns(pieces, counts, device, upload=_needed(pieces, kinds, owned=True))
        located = _located(pieces, kinds, positions, values, column, compact=False)
        located.keep = _owned(pieces, kinds, positions, column)
        return located if defer or located.keep is None else compact(located, int(located.keep.sum()))
    host = _Columns(pieces, counts, positions.device, known=known)
    if device is None:
        return _located(pieces, kinds, positions, values, host, compact=True)
    owned = _owned(pieces, kinds, positions, host)
    if owned is not None:
        keep = torch.nonzero(owned).squeeze(1)  # a host tensor: no device sync
        positions, values = positions.index_select(0, keep), values.index_select(0, keep)
        counts = (
            [keep.numel()]
            if len(pieces) == 1
            # host tensors, so no device sync either
            else torch.bincount(host.piece().index_select(0, keep), minlength=len(pieces)).tolist()
        )
    narrow = max(p.numel for p in pieces) < 1 << 31
    positions = positions.to(torch.int32 if narrow else torch.int64).to(device, non_blocking=True)
    values = values.to(device, non_blocking=True)
    return _located(
        pieces,
        kinds,
        positions.to(torch.int64),
        values,
        _Columns(pieces, counts, device, upload=_needed(pieces, kinds, owned=False)),
        compact=False,
    )


def _needed(pieces: list[Piece], kinds: Landing, *, owned: bool) -> list[str]:
    """The per-piece numbers the offsets (and with `owned`, the ownership mask) ask for."""
    if kinds.shifted:
        keys = ["slot", "shift"]
    else:
        ndim = max(len(p.seg.sizes) for p in pieces)
        keys = ["slot", "src_offset", "dst_offset", *(f"{k}{d}" for d in range(ndim) for k in ("src", "dst"))]
        if owned and not kinds.dense:
            keys += [f"size{d}" for d in range(ndim)]
    if owned and not kinds.whole and kinds.dense:
        keys += [k for k in ("src_offset", "src_last") if k not in keys]
    return keys


def compact(located: Located, count: int) -> Located:
    """Only the owned entries (`count` of them): no device sync (nonzero_static; an
    empty input crashed it on CUDA before torch 2.9, so none is passed)."""
    keep = (
        torch.nonzero_static(located.keep, size=count).squeeze(1)
        if count
        else torch.zeros(0, dtype=torch.int64, device=located.keep.device)
    )
    slots = located.slots if isinstance(located.slots, int) else located.slots.index_select(0, keep)
    return Located(
        *(t.index_select(0, keep) for t in (located.positions, located.offsets, located.values)), slots
    )


class _Columns:
    """Per-piece numbers as per-entry columns: an int where every piece agrees, else a per-piece table
    gathered by piece id. With `upload` (the device path's keys), those that differ cross in one upload."""

    def __init__(
        self,
        pieces: list[Piece],
        counts: list[int],
        device: torch.device,
        *,
        upload: list[str] | None = None,
        known: Known | None = None,
    ) -> None:
        self.pieces, self.counts, self.device, self.upload = pieces, counts, device, upload
        self.total = sum(counts)
        self.numbers: dict[str, list[int]] = {} if known is None else known.numbers
        self.tables: dict[str, torch.Tensor] | None = (
            None if known is None or device.type != "cpu" else known.tables
        )
        self.rows: dict[str, int] = {}
        self.table: torch.Tensor | None = None
        self._piece: torch.Tensor | None = None
        if upload:
            varying = [k for k in upload if not _same(self._numbers(k))]
            if varying:
                self.rows = {k: i for i, k in enumerate(varying)}
                table = torch.tensor([self.numbers[k] for k in varying] + [counts], dtype=torch.int64)
                self.table = table.to(device, non_blocking=True)

    def _numbers(self, key: str) -> list[int]:
        got = self.numbers.get(key)
        if got is None:
            got = self.numbers[key] = _number(self.pieces, key)
        return got

    def piece(self) -> torch.Tensor:
        """Each entry's piece id, made on first need."""
        if self._piece is None:
            n = len(self.counts)
            counts = (
                self.table[-1]
                if self.table is not None
                else torch.tensor(self.counts, dtype=torch.int64, device=self.device)
            )
            self._piece = torch.repeat_interleave(
                torch.arange(n, device=self.device), counts, output_size=self.total
            )
        return self._piece

    def __call__(self, key: str) -> torch.Tensor | int:
        per_piece = self._numbers(key)
        if _same(per_piece):
            return per_piece[0]
        if self.upload:  # a key not uploaded is a KeyError: never a blocking copy of its own
            return self.table[self.rows[key]].index_select(0, self.piece())
        table = None if self.tables is None else self.tables.get(key)
        if table is None:
            table = torch.tensor(per_piece, dtype=torch.int64, device=self.device)
            if self.tables is not None:
                self.tables[key] = table
        return table.index_select(0, self.piece())


def _same(per_piece: list[int]) -> bool:
    return per_piece.count(per_piece[0]) == len(per_piece)


def _dim(p: Piece, d: int) -> tuple[int, int, int]:
    if d >= len(p.seg.sizes) or p.seg.sizes[d] == 1 or p.seg.src_strides[d] == 0:
        return 1, _NO_DIM, 0  # index 0 whatever its stride (a size-1 dim's may be any number)
    return p.seg.sizes[d], p.seg.src_strides[d], p.seg.dst_strides[d]


def _number(pieces: list[Piece], key: str) -> list[int]:
    """One per-piece number: the slot, the segment's bounds or its affine map (`size3`: dim 3's size)."""
    if key == "shift":
        return list(map(sub, _number(pieces, "dst_offset"), _number(pieces, "src_offset")))
    if key in ("slot", "src_offset", "src_last", "dst_offset"):
        return list(map(attrgetter(key if key == "slot" else f"seg.{key}"), pieces))
    kind, d = key[:-1], int(key[-1])
    return [_dim(p, d)[("size", "src", "dst").index(kind)] for p in pieces]


def _owned(
    pieces: list[Piece], kinds: Landing, positions: torch.Tensor, column: _Columns
) -> torch.Tensor | None:
    """Which entries land (None: all of them)."""
    if kinds.whole:
        return None
    if kinds.dense:  # every id from src_offset to src_last: a range
        return (positions >= column("src_offset")) & (positions <= column("src_last"))
    return _affine(pieces, positions, column, owned=True)[1]


def _located(
    pieces: list[Piece],
    kinds: Landing,
    positions: torch.Tensor,
    values: torch.Tensor,
    column: _Columns,
    *,
    compact: bool,
) -> Located:
    """Offsets of every entry; with `compact`, only the owned entries are kept (else all are owned)."""
    slots = column("slot")
    owned = None
    if kinds.shifted:
        offsets = positions + column("shift")
        if compact:
            owned = _owned(pieces, kinds, positions, column)  # shifted pieces are dense: a range, or all
    else:
        offsets, owned = _affine(pieces, positions, column, owned=compact)
    if owned is not None:
        keep = torch.nonzero(owned).squeeze(1)
        positions, offsets, values = (t.index_select(0, keep) for t in (positions, offsets, values))
        if isinstance(slots, torch.Tensor):
            slots = slots.index_select(0, keep)
    return Located(positions, offsets, values, slots)


def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _affine(
    pieces: list[Piece], positions: torch.Tensor, column: _Columns, *, owned: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The general strided map, each dim's size and strides gathered per entry; with `owned`, also the
    mask of the entries it holds."""
    rest = positions - column("src_offset")
    offsets = torch.zeros_like(rest) + column("dst_offset")
    mask = rest >= 0 if owned else None
    for d in range(max(len(p.seg.sizes) for p in pieces)):
        s = column(f"src{d}")
        i = torch.div(rest, s, rounding_mode="floor")
        if mask is not None:
            mask &= i < column(f"size{d}")
        rest -= i * s
        offsets += i * column(f"dst{d}")
    if mask is not None:
        mask &= rest == 0
    return offsets, mask
