"""Decoding a block-indexed flush's params together: a fixed number of numpy calls per batch of params.

Why: at a production tensor count (44k checkpoint tensors of a few dozen changes each) the
per-param path (flush._plan_blocked / _decode_blocked) spends about 0.3 ms a tensor on index
parsing, numpy calls and zstd frames, whatever the number of changes. Here every param's block
index is parsed as one array, frames are decompressed with one reused context, and each stream
of a batch of params is decoded with a constant number of numpy ops.

A fast path only: input it does not expect (an encoding without a batched decoder, implicit
positions, raw streams, a frame whose header does not state its exact size, any failing check,
any zstd error) raises `Fallback`, and the caller decodes from there on the per-param path, which
raises the precise error. So each check of that path holds here too, or a stricter one does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
import math
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, compress, repeat
from operator import attrgetter, is_not, itemgetter

import numpy as np
import torch
import zstandard

from . import batch_device, blocks, codecs, container
from .codecs import GAP_WIDTHS
from .dtypes import DType, by_name
from .encodings import Encoding, GapPlanes, Gaps, RawValues, UlpSteps, ValuePlanes
from .errors import DeltaError

BATCH_ENTRIES = 1 << 19  # decoded entries per batch: bounds its temporaries (about 100 B an entry)
# A param with this many wanted entries decodes on the per-param path: there its per-param cost is
# paid back, and its contiguous views decode a change 3-6x cheaper than the batch's gathers
# (2 M changes in 24 params: ulp_zstd 17 vs 50-57 ns a change, deltas_zstd 27 vs 153-168 ns).
PER_PARAM_ENTRIES = 1 << 13
# Entries of a batch's device part (batch_device.py): its ~86 ops (ulp_zstd) are launches on a GPU, so a
# batch holds more there (its int64 temporaries, about 120 B an entry, in device memory: ~0.5 GB).
DEVICE_BATCH_ENTRIES = 1 << 22


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


def _supported(enc: Encoding) -> bool:
    return (isinstance(enc.positions, (GapPlanes, Gaps))
            and isinstance(enc.values, (UlpSteps, ValuePlanes, RawValues)) and enc.compression != "none")


def _streams(enc: Encoding, width: int, itemsize: int) -> list[str]:
    """The streams the writer lists for a param of this gap width and value width, in its order."""
    pos = [f"pos{j}" for j in range(width)] if isinstance(enc.positions, GapPlanes) else ["positions"]
    if isinstance(enc.values, UlpSteps):
        val = ["sign", "flag", *(f"esc{j}" for j in range(itemsize))]
    elif isinstance(enc.values, ValuePlanes):
        val = [f"val{j}" for j in range(itemsize)]
    else:
        val = ["values"]
    return pos + val


_FIELDS = ("name", "dtype", "shape", "count", "width", "streams", "blocks")
_HEAD, _FRAMES = itemgetter(0, 1, 2), itemgetter(3)  # a block row's [first, last, count], its frame lengths
_GETTER = itemgetter(*_FIELDS)


@dataclass
class Heads:
    """A block-indexed flush's `params` metadata as columns (`_FIELDS`, one tuple each, in flush order).

    Why: validated by its schema (flush._BlockedParamMeta) and walked a param at a time, it cost
    a few microseconds a tensor; `of` checks the JSON's entries as columns instead.
    """

    name: tuple
    dtype: tuple
    shape: tuple
    count: tuple
    width: tuple
    streams: tuple
    blocks: tuple
    rows: Rows | None = None  # the block rows already as arrays (wire/params_columns.py): `blocks` unused

    @classmethod
    def of(cls, raw: object) -> Heads | None:
        """The columns of `raw` (parsed JSON) when its schema takes every entry as it is: each a dict of
        exactly `_FIELDS`, of exact types (str, a list of ints >= 0, an int >= 1, an int >= 0, a list of
        str, a list); None for anything else (the schema then decides: it may coerce, or refuse)."""
        if type(raw) is not list or not raw or set(map(type, raw)) != {dict} or set(map(len, raw)) != {7}:
            return None
        try:
            heads = cls(*zip(*map(_GETTER, raw)))
        except KeyError:
            return None
        shapes = list(chain.from_iterable(heads.shape))
        if (set(map(type, heads.name)) | set(map(type, heads.dtype)) != {str}
                or set(map(type, heads.count)) | set(map(type, heads.width)) != {int}
                or set(map(type, heads.shape)) | set(map(type, heads.streams)) | set(map(type, heads.blocks)) != {list}
                or not set(map(type, shapes)) <= {int} or (shapes and min(shapes) < 0)
                or not set(map(type, chain.from_iterable(heads.streams))) <= {str}
                or min(heads.count) < 1 or min(heads.width) < 0):
            return None
        return heads

    @classmethod
    def of_models(cls, pmeta: list) -> Heads:
        """The same columns from validated entries."""
        return cls(*zip(*([getattr(p, f) for f in _FIELDS] for p in pmeta))) if pmeta else cls(*[()] * len(_FIELDS))


@dataclass
class Rows:
    """Every param's block index rows as arrays, in flush order (each row `[first, last, count, [stored,
    decoded, ...]]` in the JSON)."""

    nrows: np.ndarray  # int64 [params]: rows of each param
    head: np.ndarray  # int64 [rows, 3]: first, last, count
    frames: np.ndarray  # int64 [rows]: frame lengths each row lists (stored and decoded per stream)
    lens: np.ndarray  # int64: those lengths, row after row

    @classmethod
    def of(cls, lists: tuple) -> Rows:
        """From the parsed JSON's `blocks` lists, checked as sets, not a generator resumed a row; or
        `Fallback` (a row not of that form, or an int past int64)."""
        nrows = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        rows = list(chain.from_iterable(lists))
        if not set(map(type, rows)) <= {list} or not set(map(len, rows)) <= {4}:
            raise Fallback
        frames = list(map(_FRAMES, rows))
        if not set(map(type, frames)) <= {list}:
            raise Fallback
        heads = list(chain.from_iterable(map(_HEAD, rows)))
        lens = list(chain.from_iterable(frames))
        if not set(map(type, heads)) <= {int} or not set(map(type, lens)) <= {int}:
            raise Fallback
        try:
            head = np.array(heads, dtype=np.int64).reshape(-1, 3)
            flat = np.array(lens, dtype=np.int64)
        except (ValueError, OverflowError):
            raise Fallback from None
        return cls(nrows, head, np.fromiter(map(len, frames), dtype=np.int64, count=len(rows)), flat)


def parse(enc: Encoding, smeta: Mapping, data: Mapping[str, memoryview], meta: Heads, *, file: str,
          expected: Mapping | None) -> FlushIndex:
    """Validate every param's head and block index against the streams at once (or `Fallback`: the
    per-param path then raises the precise error, or decodes what this path does not take).

    `meta`: the params' metadata. The heads' checks (flush._Heads's) as columns: each distinct (dtype,
    shape) once; the model's shape and dtype for every param in one comparison; the change counts in
    one array comparison."""
    if not _supported(enc) or any(s.codec != "zstd" for s in smeta.values()) or not meta.name:
        raise Fallback
    columns = {s: j for j, s in enumerate(smeta)}
    shapes = list(map(tuple, meta.shape))
    keys = list(zip(meta.dtype, shapes))
    known: dict[tuple, tuple[DType, int]] = {}
    try:
        for dname, shape in set(keys):
            numel_k = math.prod(shape)
            codecs.check_numel(numel_k)
            known[(dname, shape)] = (by_name(dname), numel_k)
    except DeltaError:
        raise Fallback from None
    got = list(map(known.__getitem__, keys))
    dtypes = list(map(itemgetter(0), got))  # no Python loop a param (session 9)
    numel = list(map(itemgetter(1), got))
    torch_dtypes = list(map(attrgetter("torch"), dtypes))
    # The model's (shape, dtype) of every param in one comparison (a torch.Size equals its tuple).
    if expected is not None and list(map(expected.get, meta.name)) != list(zip(shapes, torch_dtypes)):
        raise Fallback
    if not set(meta.width) <= set(GAP_WIDTHS):
        raise Fallback
    itemsizes = list(map(attrgetter("itemsize"), torch_dtypes))
    skeys = list(zip(meta.width, itemsizes, map(tuple, meta.streams)))
    stream_cols: dict[tuple, list[int]] = {}
    try:
        for width, itemsize, listed in set(skeys):
            if list(listed) != _streams(enc, width, itemsize):
                raise Fallback
            stream_cols[(width, itemsize, listed)] = [columns[s] for s in listed]
    except KeyError:
        raise Fallback from None
    cols = list(map(stream_cols.__getitem__, skeys))
    widths = meta.width
    block_rows = meta.rows or Rows.of(meta.blocks)
    nrows, head, flat = block_rows.nrows, block_rows.head, block_rows.lens
    if not nrows.all():
        raise Fallback
    nstreams = np.fromiter(map(len, cols), dtype=np.int64, count=len(cols))
    per_row = np.repeat(nstreams, nrows)
    if not np.array_equal(block_rows.frames, 2 * per_row):
        raise Fallback
    nrow_total = head.shape[0]
    row0 = np.concatenate(([0], np.cumsum(nrows)))
    first, last, cnt = head[:, 0], head[:, 1], head[:, 2]
    numel_a = np.array(numel, dtype=np.int64)
    try:
        count_a = np.array(meta.count, dtype=np.int64)
    except OverflowError:
        raise Fallback from None
    if bool((count_a > numel_a).any()):
        raise Fallback
    pid = np.repeat(np.arange(nrows.size), nrows)
    same = pid[1:] == pid[:-1]
    ends = row0[1:] - 1
    notlast = np.ones(nrow_total, dtype=bool)
    notlast[ends] = False
    ok = (bool((first[row0[:-1]] >= 0).all()) and bool((last[ends] < numel_a).all())
          and bool((first <= last).all()) and bool((last[:-1][same] < first[1:][same]).all())
          and bool((cnt <= last - first + 1).all()) and bool((cnt >= 1).all())
          and np.array_equal(np.add.reduceat(cnt, row0[:-1]), count_a)
          and bool((cnt[notlast] % 8 == 0).all()) and bool((flat >= 0).all()))
    if not ok:
        raise Fallback
    # Each row's stream columns: its param's, row after row (ranges of the params' concatenated columns).
    col_start = np.cumsum(nstreams) - nstreams
    col = np.fromiter(chain.from_iterable(cols), dtype=np.int64, count=int(nstreams.sum()))[
        np.repeat(col_start[pid] - (np.cumsum(per_row) - per_row), per_row) + np.arange(int(per_row.sum()))]
    rid = np.repeat(np.arange(nrow_total), per_row)
    shape2 = (nrow_total, len(columns))
    has = np.zeros(shape2, dtype=bool)
    stored = np.zeros(shape2, dtype=np.int64)
    decoded = np.zeros(shape2, dtype=np.int64)
    has[rid, col] = True
    stored[rid, col] = flat[0::2]
    decoded[rid, col] = flat[1::2]
    sizes = np.array([len(data[s]) for s in columns], dtype=np.int64)
    declared = np.array([smeta[s].size for s in columns], dtype=np.int64)
    if not (np.array_equal(stored.sum(axis=0), sizes) and np.array_equal(decoded.sum(axis=0), declared)):
        raise Fallback
    return FlushIndex(list(meta.name), dtypes, shapes, numel_a, count_a, np.array(widths, dtype=np.int64),
                      np.array(itemsizes, dtype=np.int64), row0, first, last, cnt, has,
                      stored, decoded, np.cumsum(stored, axis=0) - stored, columns, pid)


def wanted(ix: FlushIndex, owned: Mapping | None) -> np.ndarray:
    """Per row: does the block meet its param's owned ranges (`blocks.wanted`, for all params at once)."""
    rows = ix.first.size
    if owned is None:
        return np.ones(rows, dtype=bool)
    lo = np.zeros(len(ix.names), dtype=np.int64)
    hi = ix.numel - 1
    got = list(map(owned.get, ix.names))
    given = list(map(is_not, got, repeat(None)))  # as columns: no Python loop a param (session 9)
    at = np.flatnonzero(np.array(given, dtype=bool))
    ranges = np.fromiter(map(len, compress(got, given)), dtype=np.int64, count=at.size)
    one = at[ranges == 1]  # merged, a range is itself
    if one.size:
        lo[one], hi[one] = np.array(list(map(itemgetter(0), map(got.__getitem__, one.tolist()))),
                                    dtype=np.int64).reshape(-1, 2).T
    special = []
    for p in at[ranges != 1].tolist():
        merged = blocks.merge(got[p])
        if len(merged) == 1:
            lo[p], hi[p] = merged[0]
        else:
            special.append((p, merged))
    mask = (ix.first <= hi[ix.pid]) & (ix.last >= lo[ix.pid])
    for p, merged in special:  # several ranges (or none): the per-param rule
        a, b = ix.row0[p], ix.row0[p + 1]
        sub = blocks.BlockIndex(ix.first[a:b], ix.last[a:b], ix.cnt[a:b], ix.stored[a:b], ix.decoded[a:b])
        mask[a:b] = blocks.wanted(sub, merged)
    return mask


def _frames(stream: memoryview, offset: np.ndarray, stored: np.ndarray, decoded: np.ndarray) -> bytes:
    """The frames at `offset`/`stored` decompressed back to back, each to exactly its `decoded` size.

    Each frame is held to what `container.decompress` checks (its header states exactly the size the
    index gives; it decodes to that; no bytes follow it in its span), or `Fallback`: the header and
    the frame's extent are read here (RFC 8878) since zstd's batch call reports neither; the output
    buffers are sized from the index, never from a header. A frame of one stored (raw) or RLE block
    (`_check_frames` says which) is copied out as it is: what zstd would give, with no call and no
    Python object a frame (a tensor of a few changes has five frames of a few bytes, 220k at 44k
    tensors). The others go through one zstd call for all of them.
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
            got = container.decompressor().multi_decompress_to_buffer(
                zstandard.BufferWithSegments(stream, segments.tobytes()),
                decompressed_sizes=decoded[rest].astype(np.uint64).tobytes())
        except zstandard.ZstdError:
            raise Fallback from None
        out[_spans(at[rest], decoded[rest])] = np.frombuffer(b"".join(got), dtype=np.uint8)
    return out.tobytes()


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the runs `starts[i]`, `lengths[i]` long, back to back."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if ends.size else 0)


_DICT_ID_BYTES = np.array([0, 1, 2, 4], dtype=np.int64)
_MAX_BLOCKS = 64  # blocks walked per frame before handing the frame to the per-param path
_MAX_BLOCK = 1 << 17  # zstd's largest block (Block_Maximum_Size)


def _check_frames(buf: np.ndarray, offset: np.ndarray, stored: np.ndarray, decoded: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Every frame is one zstd frame filling its span exactly, whose header declares `decoded` bytes.

    Per frame: 0 (a stored block) or 1 (an RLE block) where it is one such block of exactly `decoded`
    bytes in a single-segment frame with no dictionary and no checksum (zstd would give that block's
    bytes, or its byte repeated, and check nothing more), else -1; and where that block's content starts.
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
    lone = size = None
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
    plain = ((lone == 0) | (lone == 1)) & (single == 1) & ((fhd & 3) == 0) & (checksum == 0) & (size == decoded) & (
        size <= _MAX_BLOCK)
    return np.where(plain, lone, -1), start


class _Batch:
    """The wanted rows of a run of params, with the entry bookkeeping every stream decoder shares."""

    def __init__(self, ix: FlushIndex, data: Mapping[str, memoryview], rows: np.ndarray, run_start: np.ndarray):
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
        return np.frombuffer(_frames(self.data[name], ix.offset[r, j], ix.stored[r, j], ix.decoded[r, j]),
                             dtype=np.uint8)

    def planes(self, prefix: str, width: np.ndarray, width_e: np.ndarray, want: np.ndarray, count: int) -> np.ndarray:
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
        ok = (bool((pos >= 0).all()) and bool((pos < numel_e).all())
              and bool((pos[1:][inside[1:]] > pos[:-1][inside[1:]]).all())
              and np.array_equal(pos[self.estart], ix.first[rows])
              and np.array_equal(pos[self.estart + self.cnt - 1], ix.last[rows]))
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


def decode(enc: Encoding, ix: FlushIndex, data: Mapping[str, memoryview], owned: Mapping | None,
           make: Callable, fallback: Callable[[int, int], Iterator], make_batch: Callable | None = None) -> Iterator:
    """Decode the params a batch at a time; a batch this path does not take, and a param of at least
    PER_PARAM_ENTRIES wanted entries, go to `fallback(p, q)` (the per-param path for params p..q-1),
    then on to the next batch.

    With `owned` a `batch_device.Destinations`, the params it places on a device are decoded
    there (batch_device.py), apart from the batch's host params and up to DEVICE_BATCH_ENTRIES,
    whatever each param's size (the device has no per-param path to prefer); their checks are left
    in `owned` for its `verify`.

    `make(p, positions, values, skipped, bounds, blocks)` builds param p's delta from torch views
    (values: signed-integer steps for a base-relative encoding, else new values in the param's dtype).
    With `make_batch(p, q, positions, values, types, sizes, skipped, first, last, blocks, nbytes)`, a batch
    decoded on the host alone is yielded as one object, with no call or view a param: every entry's
    positions in one tensor, values in one tensor per value type (`types`: each param's, a key of
    `values`), and lists over params p..q-1 (`sizes`: each param's entries, in order).
    """
    mask = wanted(ix, owned)
    pid = ix.pid
    run_start = mask.copy()  # a wanted row whose predecessor in its param is not wanted
    run_start[1:] &= ~(mask[:-1] & (pid[1:] == pid[:-1]))
    per_param = np.add.reduceat(np.where(mask, ix.cnt, 0), ix.row0[:-1])
    nparams = len(ix.names)
    devices = getattr(owned, "devices", None) or {}
    where = list(map(devices.get, ix.names)) if devices else [None] * nparams
    on_dev = np.fromiter(map(is_not, where, repeat(None)), dtype=bool, count=nparams)
    kinds = {d: i for i, d in enumerate(dict.fromkeys(compress(where, on_dev.tolist())))}
    kind = np.fromiter(map(kinds.get, where, repeat(-1)), dtype=np.int64, count=nparams)
    # A batch holds host params and params of one device (each part decoded on its own, yielded in order).
    latest = np.maximum.accumulate(np.where(on_dev, np.arange(nparams), -1))  # the last device param so far
    dev_kind = np.where(latest >= 0, kind[np.maximum(latest, 0)], -1)
    changes = np.flatnonzero(dev_kind[1:] != dev_kind[:-1]) + 1 if len(kinds) > 1 else np.zeros(0, dtype=np.int64)
    large = np.flatnonzero((per_param >= min(PER_PARAM_ENTRIES, BATCH_ENTRIES)) & ~on_dev)
    p = 0
    while p < nparams:
        here = per_param[p:]
        q = p + min(int(np.searchsorted(np.cumsum(np.where(on_dev[p:], 0, here)), BATCH_ENTRIES, side="right")),
                    int(np.searchsorted(np.cumsum(np.where(on_dev[p:], here, 0)), DEVICE_BATCH_ENTRIES, side="right")))
        c = int(np.searchsorted(changes, p, side="right"))
        q = min(q, int(changes[c]) if c < changes.size else nparams)
        k = int(np.searchsorted(large, p))
        q = min(q, int(large[k]) if k < large.size else nparams)  # a batch stops before a large host param
        if q == p and not on_dev[p]:  # a large param: its own decode holds no more than the per-param path's
            yield from fallback(p, p + 1)
            p += 1
            continue
        q = max(q, p + 1)  # a device param past DEVICE_BATCH_ENTRIES is a batch of its own
        a, b = int(ix.row0[p]), int(ix.row0[q])
        rows = a + np.flatnonzero(mask[a:b])
        dev_row = on_dev[pid[rows]]
        first_dev = np.flatnonzero(on_dev[p:q])
        device = where[p + int(first_dev[0])] if first_dev.size else None
        try:
            parts = {}
            for there in (False, True):
                if (on_dev[p:q] == there).any():
                    sub = _Batch(ix, data, rows[dev_row == there], run_start)
                    parts[there] = (batch_device.decode(sub, enc, device, owned) if there
                                    else (torch.from_numpy(sub.positions(enc)), sub.values(enc)))
        except Fallback:
            yield from fallback(p, q)
            p = q
            continue
        if True in parts:
            owned.decoded.update(ix.names[i] for i in range(p, q) if on_dev[i])
        sizes_at = set(ix.itemsize[p:q].tolist())
        by_size = {there: batch_device.narrow(vals, sizes_at) if there else
                   {i: torch.from_numpy(vals.astype(f"<u{i}").view(f"<i{i}")) for i in sizes_at}
                   for there, (_, vals) in parts.items()}
        sizes = per_param[p:q].tolist()
        kinds_k = on_dev[p:q].tolist()
        # Each param's views made by one split per part and value type (a Python slice costs ~2 us a
        # view, 44k tensors two each): steps stay signed integers, new values are viewed in the dtype.
        types = ix.itemsize[p:q].tolist() if enc.needs_base else [d.torch for d in ix.dtypes[p:q]]
        views = {}
        for there, (pos, _) in parts.items():
            if make_batch is not None and True not in parts:
                break  # a DeltaBatch takes the batch's tensors whole: no view a param
            lens = [n for n, on in zip(sizes, kinds_k) if on == there]
            split = {}
            for t in dict.fromkeys([t for t, on in zip(types, kinds_k) if on == there]):
                vals = by_size[there][t if enc.needs_base else t.itemsize]
                split[t] = vals.split(lens) if enc.needs_base else vals.view(t).split(lens)
            views[there] = (iter(pos.split(lens)), split, iter(range(len(lens))))
        nwanted = np.add.reduceat(mask[a:b].astype(np.int64), ix.row0[p:q] - a).tolist()
        row0 = ix.row0[p:q + 1]
        first, last = ix.first[row0[:-1]].tolist(), ix.last[row0[1:] - 1].tolist()
        nrows = np.diff(row0).tolist()
        count = ix.count[p:q].tolist()
        if make_batch is not None and True not in parts:  # one object for the batch (wire/flush.DeltaBatch)
            vals = by_size[False]
            values = {t: vals[t] if enc.needs_base else vals[t.itemsize].view(t) for t in dict.fromkeys(types)}
            nbytes = parts[False][0].nbytes + int(np.dot(per_param[p:q], ix.itemsize[p:q]))
            yield make_batch(p, q, parts[False][0], values, types, sizes, list(map(int.__sub__, count, sizes)),
                             first, last, list(zip(nwanted, nrows)), nbytes)
            p = q
            continue
        for k in range(q - p):  # made as consumed, so few params live at once
            pos, split, at = views[kinds_k[k]]
            yield make(p + k, next(pos), split[types[k]][next(at)], count[k] - sizes[k],
                       (first[k], last[k]), (nwanted[k], nrows[k]))
        p = q
