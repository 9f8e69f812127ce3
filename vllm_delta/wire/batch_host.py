"""A batch of block-indexed params decoded on the host: a constant number of numpy ops per stream.

The rows of a batch (wire/batch.py) share one entry bookkeeping; each stream decoder gathers its
bytes from the decompressed frames (wire/batch_frames.py). Any check that fails raises `Fallback`:
the per-param path (wire/flush.py) then decodes those params and raises the precise error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .batch_frames import Fallback, frames
from .dtypes import DType
from .encodings import Encoding, GapPlanes, RawValues, ValuePlanes


@dataclass
class FlushIndex:
    """Every param's block index of one flush, validated, as flat arrays (rows: blocks in flush order)."""

    names: list[str]
    dtypes: list[DType]
    shapes: list[tuple[int, ...]]
    numel: np.ndarray  # int64 [params]
    count: np.ndarray  # int64 [params]
    width: np.ndarray  # int64 [params]
    itemsize: np.ndarray  # int64 [params]
    row0: np.ndarray  # int64 [params + 1]: param p's rows are row0[p]:row0[p+1]
    first: np.ndarray  # int64 [rows]
    last: np.ndarray
    cnt: np.ndarray
    has: np.ndarray  # bool [rows, streams]: the row's param lists the stream
    stored: np.ndarray  # int64 [rows, streams] (0 where not listed)
    decoded: np.ndarray
    offset: np.ndarray  # int64 [rows, streams]: where the row's frame starts in its stream
    columns: dict[str, int]  # stream name -> column
    pid: np.ndarray  # int64 [rows]: each row's param


class HostBatch:
    """The wanted rows of a run of params, with the entry bookkeeping every stream decoder shares."""

    def __init__(
        self, ix: FlushIndex, data: Mapping[str, memoryview], rows: np.ndarray, run_start: np.ndarray
    ):
        self.ix, self.data, self.rows = ix, data, rows
        self.cnt = ix.cnt[rows]
        self.entries = int(self.cnt.sum())
        self.estart = np.cumsum(self.cnt) - self.cnt  # each row's first entry in the batch
        self.run_start = run_start[rows]

    @cached_property
    def row_of(self) -> np.ndarray:
        """Each entry's row (in the batch): the host path's, never made for a device decode."""
        return np.repeat(np.arange(self.rows.size), self.cnt)

    @cached_property
    def pid_e(self) -> np.ndarray:
        return self.ix.pid[self.rows][self.row_of]

    def stream(self, name: str, want: np.ndarray) -> np.ndarray:
        """Stream `name`'s decoded bytes for the rows that list it; each must decode to `want` bytes."""
        ix = self.ix
        j = ix.columns.get(name)
        if j is None:
            raise Fallback
        listed = ix.has[self.rows, j]
        r = self.rows[listed]
        if not np.array_equal(ix.decoded[r, j], want[listed]):
            raise Fallback
        return np.frombuffer(
            frames(self.data[name], ix.offset[r, j], ix.stored[r, j], ix.decoded[r, j]), dtype=np.uint8
        )

    def planes(
        self, prefix: str, width: np.ndarray, width_e: np.ndarray, want: np.ndarray, count: int
    ) -> np.ndarray:
        """Byte planes `prefix0..` of `count` entries into uint64 (plane j: entries whose width > j).

        `width` per row: every plane a row lists is read and its size checked, even with no entries in it.
        """
        out = np.zeros(count, dtype=np.uint64)
        for j in range(int(width.max()) if width.size else 0):
            raw = self.stream(f"{prefix}{j}", want)
            sel = width_e > j
            if raw.size != int(sel.sum()):
                raise Fallback
            if j == 0 and bool(sel.all()):
                out |= raw.astype(np.uint64)
            else:
                out[sel] |= raw.astype(np.uint64) << np.uint64(8 * j)
        return out

    def gather(self, name: str, bytes_per_entry: np.ndarray) -> np.ndarray:
        """Stream `name` (every row lists it), `bytes_per_entry[row]` bytes an entry: each entry's bytes,
        little-endian, into uint64."""
        want = self.cnt * bytes_per_entry
        raw = self.stream(name, want)
        if raw.size != int(want.sum()):
            raise Fallback
        w_e = bytes_per_entry[self.row_of]
        out = np.zeros(self.entries, dtype=np.uint64)
        base = np.cumsum(w_e) - w_e  # each entry's first byte
        for j in range(int(w_e.max()) if self.entries else 0):
            sel = w_e > j
            out[sel] |= raw[base[sel] + j].astype(np.uint64) << np.uint64(8 * j)
        return out

    def positions(self, enc: Encoding) -> np.ndarray:
        """Validated int64 positions (gaps continue within a run of blocks; `codecs.decode_gaps`)."""
        ix, rows = self.ix, self.rows
        width = ix.width[ix.pid[rows]]
        if isinstance(enc.positions, GapPlanes):
            gaps = self.planes("pos", width, width[self.row_of], self.cnt, self.entries)
        else:
            gaps = self.gather("positions", width)
        numel_e = ix.numel[self.pid_e]
        if not self.entries:
            return np.zeros(0, dtype=np.int64)
        if not bool((gaps < numel_e.astype(np.uint64)).all()):
            raise Fallback
        cs = np.cumsum(gaps.astype(np.int64) + 1)
        first_rows = np.flatnonzero(self.run_start)  # rows (in the batch) where a run starts
        starts = self.estart[first_rows]
        before = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0)
        r = rows[first_rows]
        is_head = r == ix.row0[ix.pid[r]]
        prev = np.where(is_head, -1, ix.last[np.maximum(r - 1, 0)])
        run_len = np.diff(np.concatenate((starts, [self.entries])))
        pos = cs + np.repeat(prev - before, run_len)
        inside = np.ones(self.entries, dtype=bool)
        inside[starts] = False
        ok = (
            bool((pos >= 0).all())
            and bool((pos < numel_e).all())
            and bool((pos[1:][inside[1:]] > pos[:-1][inside[1:]]).all())
            and np.array_equal(pos[self.estart], ix.first[rows])
            and np.array_equal(pos[self.estart + self.cnt - 1], ix.last[rows])
        )
        if not ok:
            raise Fallback
        return pos

    def values(self, enc: Encoding) -> np.ndarray:
        """Value payloads as uint64 (new bits, or wrapping ULP steps), one per entry."""
        ix, rows = self.ix, self.rows
        isz = ix.itemsize[ix.pid[rows]]
        if isinstance(enc.values, RawValues):
            return self.gather("values", isz)
        isz_e = isz[self.row_of]
        if isinstance(enc.values, ValuePlanes):
            return self.planes("val", isz, isz_e, self.cnt, self.entries)
        neg = self.bits("sign")
        big = self.bits("flag")
        nbig = np.add.reduceat(big.astype(np.int64), self.estart) if self.entries else self.cnt
        esc = self.planes("esc", isz, isz_e[big], nbig, int(nbig.sum()))
        mag = np.ones(self.entries, dtype=np.uint64)
        mag[big] = esc + np.uint64(2)
        return np.where(neg, np.uint64(0) - mag, mag)

    def bits(self, name: str) -> np.ndarray:
        """A packed bit stream (a block's bytes hold its entries' bits, padded at the param's end)."""
        want = (self.cnt + 7) // 8
        raw = self.stream(name, want)
        if raw.size != int(want.sum()):
            raise Fallback
        bits = np.unpackbits(raw)
        byte0 = np.cumsum(want) - want
        idx = np.repeat(8 * byte0 - self.estart, self.cnt) + np.arange(self.entries)
        return bits[idx].astype(bool)
