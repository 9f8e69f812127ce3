"""One pass per (batch, destination): locate every checkpoint tensor feeding a destination at once. Why: a
fused MoE parameter is fed by hundreds of expert tensors, and a per-tensor loop cost ~1.5 ms a tensor (70 s
at 46k); off the CPU the ownership filter stays on the host, so only owned entries cross and nothing syncs.
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
        dense = seg.src_last - seg.src_offset + 1 == seg.numel  # every id in the range (they are distinct)
        same = all(n == 1 or a == b for n, a, b in zip(seg.sizes, seg.src_strides, seg.dst_strides))
        return cls(dense and seg.src_offset == 0 and seg.numel == numel, dense, dense and same)


@dataclass(slots=True)  # slotted: one is made per (tensor, segment) every sync
class Piece:
    """The decoded entries of one checkpoint tensor (or a chunk of it) and one segment it lands through."""

    slot: int  # the tensor's row in the batch's digest sums
    positions: torch.Tensor | None  # sorted flat ids in the checkpoint tensor (None: `locate`'s `entries`)
    values: torch.Tensor | None
    seg: Segment
    numel: int  # elements of the checkpoint tensor
    landing: Landing | None = None  # `Landing.of(seg, numel)`, when the caller keeps it


class Group:
    """One destination's pieces (their tensors in slot order) and what `locate` works out of the pieces
    alone (kinds, per-piece numbers, host tables): a decoded batch's plan keeps it, as its pieces recur."""

    __slots__ = ("names", "pieces", "kinds", "numbers", "tables")

    def __init__(self, names: list[str], pieces: list[Piece]) -> None:
        self.names, self.pieces = names, pieces
        self.kinds: Landing | None = None
        self.numbers: dict[str, list[int]] = {}
        self.tables: dict[str, torch.Tensor] = {}  # per-piece numbers that differ, as host int64

    def add(self, name: str, seg: Segment, numel: int, landing: Landing) -> None:
        """A piece of tensor `name` (a new slot unless it is the last one's), its entries in `locate`'s."""
        if not self.names or self.names[-1] != name:
            self.names.append(name)
        self.pieces.append(Piece(len(self.names) - 1, None, None, seg, numel, landing))


@dataclass
class Located:
    """Every entry of a destination's pieces this rank writes, in piece order."""

    positions: torch.Tensor  # checkpoint flat ids: the digests' keys
    offsets: torch.Tensor  # destination storage offsets
    values: torch.Tensor
    slots: torch.Tensor | int  # each entry's tensor row (an int: all the same)
    keep: torch.Tensor | None = None  # with `locate(defer=True)`: the entries this rank owns, for `compact`


_LANDING, _WHOLE, _DENSE, _SHIFTED = (attrgetter(k) for k in ("landing", "whole", "dense", "shifted"))


def _kinds(pieces: list[Piece]) -> Landing:
    """What holds for every piece (each piece's `Landing` kept by the caller or made here)."""
    landings = list(map(_LANDING, pieces))
    if None in landings:
        landings = [p.landing or Landing.of(p.seg, p.numel) for p in pieces]
    return Landing(all(map(_WHOLE, landings)), all(map(_DENSE, landings)), all(map(_SHIFTED, landings)))


# Tests set this to take the device path on the CPU (it is otherwise taken for any non-CPU destination).
FORCE_DEVICE_PATH = False


def on_device(device: torch.device) -> bool:
    """Whether a destination on `device` is located there (`locate(pieces, device)`), not on the host."""
    return device.type != "cpu" or FORCE_DEVICE_PATH


def locate(
    pieces: list[Piece] | Group,
    device: torch.device | None = None,
    *,
    defer: bool = False,
    there: bool = False,
    entries: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None,
) -> Located:
    """Destination offsets of all pieces' entries, in a constant number of ops (a `Group`'s kept).

    `device` None: everything runs where the positions are. Else the host keeps only the owned entries
    (no device sync), which cross once with one table of the per-piece numbers that differ; positions
    decoded on `device` (`there`) are masked there, the mask left in `keep` with `defer` (`compact`).
    `entries`: the pieces' entries already concatenated (a plan's).
    """
    known = pieces if isinstance(pieces, Group) else Group([], pieces)
    pieces = known.pieces
    if entries is None:
        entries = (
            cat([p.positions for p in pieces]),
            cat([p.values for p in pieces]),
            [p.positions.numel() for p in pieces],
        )
    positions, values, counts = entries
    positions = positions.to(torch.int64)
    kinds = known.kinds = known.kinds or _kinds(pieces)
    if device is not None and there:
        column = _Columns(known, counts, device, upload=_needed(pieces, kinds, owned=True))
        located = _located(pieces, kinds, positions, values, column, compact=False)
        located.keep = _owned(pieces, kinds, positions, column)
        return located if defer or located.keep is None else compact(located, int(located.keep.sum()))
    host = _Columns(known, counts, positions.device)
    if device is None:
        return _located(pieces, kinds, positions, values, host, compact=True)
    owned = _owned(pieces, kinds, positions, host)
    if owned is not None:
        keep = torch.nonzero(owned).squeeze(1)  # a host tensor: no device sync
        positions, values = positions.index_select(0, keep), values.index_select(0, keep)
        counts = (  # host tensors, so no device sync either
            [keep.numel()]
            if len(pieces) == 1
            else torch.bincount(host.piece().index_select(0, keep), minlength=len(pieces)).tolist()
        )
    narrow = max(p.numel for p in pieces) < 1 << 31
    positions = positions.to(torch.int32 if narrow else torch.int64).to(device, non_blocking=True)
    values = values.to(device, non_blocking=True)  # then the table: the order the uploads are queued in
    column = _Columns(known, counts, device, upload=_needed(pieces, kinds, owned=False))
    return _located(pieces, kinds, positions.to(torch.int64), values, column)


def _needed(pieces: list[Piece], kinds: Landing, *, owned: bool) -> list[str]:
    """The per-piece numbers the offsets (and with `owned`, the ownership mask) ask for."""
    ndim = max(len(p.seg.sizes) for p in pieces)
    keys = ["slot", "shift"] if kinds.shifted else ["slot", "src_offset", "dst_offset"]
    keys += [] if kinds.shifted else [f"{k}{d}" for d in range(ndim) for k in ("src", "dst")]
    if owned and not kinds.whole:
        keys += ["src_offset", "src_last"] if kinds.dense else [f"size{d}" for d in range(ndim)]
    return list(dict.fromkeys(keys))


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
        self, known: Group, counts: list[int], device: torch.device, *, upload: list[str] | None = None
    ) -> None:
        self.pieces, self.counts, self.device, self.upload = known.pieces, counts, device, upload
        self.numbers, self.tables = known.numbers, known.tables
        self.table: torch.Tensor | None = None
        self._piece: torch.Tensor | None = None
        varying = [k for k in upload or () if not _same(self._numbers(k))]
        self.rows = {k: i for i, k in enumerate(varying)}
        if varying:
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
            counts = (
                self.table[-1] if self.table is not None else torch.tensor(self.counts, device=self.device)
            )
            self._piece = torch.repeat_interleave(
                torch.arange(len(self.counts), device=self.device), counts, output_size=sum(self.counts)
            )
        return self._piece

    def __call__(self, key: str) -> torch.Tensor | int:
        per_piece = self._numbers(key)
        if _same(per_piece):
            return per_piece[0]
        if self.upload:  # a key not uploaded is a KeyError: never a blocking copy of its own
            return self.table[self.rows[key]].index_select(0, self.piece())
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = torch.tensor(per_piece, dtype=torch.int64, device=self.device)
        return table.index_select(0, self.piece())


def _same(per_piece: list[int]) -> bool:
    return per_piece.count(per_piece[0]) == len(per_piece)


def _number(pieces: list[Piece], key: str) -> list[int]:
    """One per-piece number: the slot, the segment's bounds or its affine map (`size3`: dim 3's size;
    a size-1, stride-0 or padded dim indexes 0 whatever its stride)."""
    if key == "shift":
        return list(map(sub, _number(pieces, "dst_offset"), _number(pieces, "src_offset")))
    if key in ("slot", "src_offset", "src_last", "dst_offset"):
        return list(map(attrgetter(key if key == "slot" else f"seg.{key}"), pieces))
    which, d = ("size", "src", "dst").index(key[:-1]), int(key[-1])
    out = []
    for p in pieces:
        s = p.seg
        flat = d >= len(s.sizes) or s.sizes[d] == 1 or s.src_strides[d] == 0
        out.append(
            (1, _NO_DIM, 0)[which] if flat else (s.sizes[d], s.src_strides[d], s.dst_strides[d])[which]
        )
    return out


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
    compact: bool = False,
) -> Located:
    """Offsets of every entry; with `compact`, only the owned entries are kept (else all are owned)."""
    slots = column("slot")
    owned = None
    if kinds.shifted:
        offsets = positions + column("shift")
        if compact:  # shifted pieces are dense: a range, or all
            owned = _owned(pieces, kinds, positions, column)
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
