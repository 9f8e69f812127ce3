"""The host's share of the batched decode: a flush's validated block index (`FlushIndex`), a batch's
rows (`HostBatch`) and their streams from zstd frames decompressed together (`frames`). A failed check
raises `Fallback`: the per-param path (wire/flush.py) decides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import zstandard

from .container import decompressor
from .dtypes import DType


class Fallback(Exception):
    """This input is for the per-param path (it may well be valid: that path decides)."""


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
    def heads(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows (in the batch) where a run of blocks starts, and the position before each run."""
        ix, at = self.ix, np.flatnonzero(self.run_start)
        r = self.rows[at]
        return at, np.where(r == ix.row0[ix.pid[r]], -1, ix.last[np.maximum(r - 1, 0)])

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


def frames(stream: memoryview, offset: np.ndarray, stored: np.ndarray, decoded: np.ndarray) -> bytes:
    """The frames at `offset`/`stored` decompressed back to back, each to exactly its `decoded` size, held
    to `container.decompress`'s checks (headers read here, RFC 8878: zstd's batch call checks neither).

    Why: a raw or RLE single-block frame (most of a small tensor's five frames: 220k at 44k tensors) is
    copied out with no call a frame; the others go through one zstd call for all of them.
    """
    if bool(((stored == 0) != (decoded == 0)).any()):
        raise Fallback  # an empty frame that decodes to something (or the reverse): the per-param path says
    keep = stored > 0
    offset, stored, decoded = offset[keep], stored[keep], decoded[keep]
    if not offset.size:
        return b""
    buf = np.frombuffer(stream, dtype=np.uint8)
    kind, start = _check_frames(buf, offset, stored, decoded)
    raw, rle = kind == 0, kind == 1
    if bool(raw.all()):
        return buf[_spans(start, decoded)].tobytes()
    out = np.empty(int(decoded.sum()), dtype=np.uint8)
    at = np.cumsum(decoded) - decoded
    if bool(raw.any()):
        out[_spans(at[raw], decoded[raw])] = buf[_spans(start[raw], decoded[raw])]
    if bool(rle.any()):
        out[_spans(at[rle], decoded[rle])] = np.repeat(buf[start[rle]], decoded[rle])
    rest = kind < 0
    if bool(rest.any()):
        segments = np.stack((offset[rest], stored[rest]), axis=1).astype(np.uint64)
        try:
            got = decompressor().multi_decompress_to_buffer(
                zstandard.BufferWithSegments(stream, segments.tobytes()),
                decompressed_sizes=decoded[rest].astype(np.uint64).tobytes(),
            )
        except zstandard.ZstdError:
            raise Fallback from None
        # zstandard's stub omits the segments' buffer protocol and the collection's indexed iteration
        joined = b"".join(got)  # type: ignore[arg-type]
        out[_spans(at[rest], decoded[rest])] = np.frombuffer(joined, dtype=np.uint8)
    return out.tobytes()


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the runs `starts[i]`, `lengths[i]` long, back to back."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if ends.size else 0)


_DICT_ID_BYTES = np.array([0, 1, 2, 4], dtype=np.int64)
_MAX_BLOCKS = 64  # blocks walked per frame before handing the frame to the per-param path
_MAX_BLOCK = 1 << 17  # zstd's largest block (Block_Maximum_Size)


def _check_frames(
    buf: np.ndarray, offset: np.ndarray, stored: np.ndarray, decoded: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every frame is one zstd frame filling its span exactly, whose header declares `decoded` bytes.

    Per frame: 0 (raw) or 1 (RLE) where it is one such block of exactly `decoded` bytes in a single-segment
    frame with no dictionary or checksum, else -1; and where that block's content starts.
    """
    end = offset + stored

    def byte(at: np.ndarray, sel: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The bytes at `at` of the frames `sel`, each inside its own span."""
        if bool((at >= end[sel]).any()):
            raise Fallback  # a header or block header runs past the span
        return buf[at].astype(np.int64)

    magic = byte(offset) | byte(offset + 1) << 8 | byte(offset + 2) << 16 | byte(offset + 3) << 24
    fhd = byte(offset + 4)
    if bool((magic != 0xFD2FB528).any()) or bool((fhd & 0b1000).any()):
        raise Fallback  # a skippable or foreign frame, or the reserved bit
    single = (fhd >> 5) & 1
    fcs_flag = fhd >> 6
    fcs_bytes = np.where(fcs_flag == 0, single, 1 << fcs_flag)  # 0 or 1, 2, 4, 8
    if bool((fcs_bytes == 0).any()):
        raise Fallback  # no content size in the header: the per-param path streams it under its cap
    at = offset + 5 + (1 - single) + _DICT_ID_BYTES[fhd & 3]
    declared = np.zeros(offset.size, dtype=np.int64)
    for j in range(8):
        sel = fcs_bytes > j
        if j < 7:
            declared[sel] |= byte(at[sel] + j, sel) << (8 * j)
        elif bool(sel.any()):  # the top byte: sizes past 2^63 are never the index's
            top = byte(at[sel] + j, sel)
            if bool((top > 0x7F).any()):
                raise Fallback
            declared[sel] |= top << 56
    declared = np.where(fcs_flag == 1, declared + 256, declared)
    if not np.array_equal(declared, decoded):
        raise Fallback
    cur = at + fcs_bytes
    start = cur + 3  # the first block's content
    open_ = np.ones(offset.size, dtype=bool)
    lone: np.ndarray  # both set by the first block walk (a frame's first block; `offset` is not empty)
    size: np.ndarray
    for i in range(_MAX_BLOCKS):
        if not bool(open_.any()):
            break
        c = cur[open_]
        head = byte(c, open_) | byte(c + 1, open_) << 8 | byte(c + 2, open_) << 16
        kind = (head >> 1) & 3
        if bool((kind == 3).any()):
            raise Fallback
        if i == 0:  # every frame's first block: the frame's kind where it is its last
            lone, size = np.where((head & 1) == 1, kind, -1), head >> 3
        cur[open_] = c + 3 + np.where(kind == 1, 1, head >> 3)  # an RLE block stores one byte
        open_[np.flatnonzero(open_)[(head & 1) == 1]] = False
    else:
        if bool(open_.any()):
            raise Fallback
    checksum = (fhd >> 2) & 1
    if not np.array_equal(cur + 4 * checksum, end):
        raise Fallback  # bytes after the frame (or a frame longer than its span)
    plain = (
        ((lone == 0) | (lone == 1))
        & (single == 1)
        & ((fhd & 3) == 0)
        & (checksum == 0)
        & (size == decoded)
        & (size <= _MAX_BLOCK)
    )
    return np.where(plain, lone, -1), start
