"""One flush: a bucket of param changes as one safetensors byte string.

The same bytes are a file on disk or a buffer broadcast over a collective. Layout: one 1-D uint8
tensor `__<stream>__` per stream, and metadata `format`, `encoding`, `current_version`,
`base_version`, `streams` (JSON: codec and decoded size per stream) and `params`.

Two flush formats are read. `vllm-delta/1`: per param its byte spans in each decoded stream
(streams compressed whole, or the whole file). `vllm-delta/2` (written by default): per param a
seekable block index (wire/blocks.py), each block one zstd frame per stream, so a receiver can
decode only the blocks whose positions it owns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from . import batch, blocks, codecs, container, params_columns
from .blocks import BlockIndex, Ranges
from .container import Limits
from .digest import bytes_digest
from .dtypes import by_name, by_torch, from_bits, to_bits
from .encodings import Encoding, get_encoding
from .errors import (BoundsError, DtypeMismatchError, FormatError, IntegrityError, LimitError,
                     ShapeMismatchError, UnknownParamError)
from .manifest import FORMAT

FORMAT_BLOCKS = "vllm-delta/2"  # flush header format of block-indexed flushes
FLUSH_FORMATS = (FORMAT, FORMAT_BLOCKS)

Expected = Mapping[str, tuple[Sequence[int], torch.dtype]]
Owned = Mapping[str, Ranges | None]  # per param: the position ranges to decode (None: all)


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

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, positions: torch.Tensor,
                 values: torch.Tensor, needs_base: bool, skipped: int = 0, bounds: tuple[int, int] | None = None,
                 blocks: tuple[int, int] = (0, 0)) -> None:
        # Why not the dataclass's own __init__: a frozen one sets each field with its own
        # object.__setattr__ call, 2.3 us an object; one __dict__ for all is 0.8 us, and a flush of
        # a production tensor count makes tens of thousands. Still frozen: assignment raises.
        object.__setattr__(self, "__dict__", {
            "name": name, "shape": shape, "dtype": dtype, "positions": positions, "values": values,
            "needs_base": needs_base, "skipped": skipped, "bounds": bounds, "blocks": blocks})

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
        return codecs.ulp_resolve_tensor(old.detach(), self.values.to(old.device))

    def apply_(self, tensor: torch.Tensor) -> None:
        """Write the changes into a full tensor of `shape` in place."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype or not tensor.is_contiguous():
            raise ValueError(f"{self.name}: target must be contiguous {self.dtype}{list(self.shape)}")
        flat = tensor.view(-1)
        pos = self.positions.to(tensor.device)
        flat[pos] = self.resolve(flat[pos] if self.needs_base else None).to(tensor.device)


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

    __slots__ = ("names", "shapes", "dtypes", "positions", "values", "types", "sizes", "needs_base", "counts",
                 "skipped", "first", "last", "nblocks", "total", "blocks", "nbytes")

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                 positions: torch.Tensor, values: dict[object, torch.Tensor], types: list, sizes: list[int],
                 needs_base: bool, counts: list[int], skipped: list[int], first: list[int], last: list[int],
                 nblocks: list[tuple[int, int]], nbytes: int) -> None:
        self.names, self.shapes, self.dtypes, self.needs_base = names, shapes, dtypes, needs_base
        self.positions, self.values, self.types, self.sizes = positions, values, types, sizes
        self.counts, self.skipped, self.first, self.last = counts, skipped, first, last  # counts: on the wire
        self.nblocks = nblocks  # per param: (decoded, indexed) blocks
        self.total = sum(counts)  # entries on the wire, decoded or skipped (`ParamDelta.total`, summed)
        decoded, indexed = zip(*nblocks) if nblocks else ((), ())
        self.blocks = (sum(decoded), sum(indexed))
        self.nbytes = nbytes  # of positions and values

    def __len__(self) -> int:
        return len(self.names)

    def deltas(self) -> Iterator[ParamDelta]:
        """The same changes, a `ParamDelta` (of views) a param."""
        positions = self.positions.split(self.sizes)
        values = {t: v.split(self.sizes) for t, v in self.values.items()}
        for i, name in enumerate(self.names):
            yield ParamDelta(name, self.shapes[i], self.dtypes[i], positions[i], values[self.types[i]][i],
                             self.needs_base, self.skipped[i], (self.first[i], self.last[i]), self.nblocks[i])


@dataclass(frozen=True)
class EncodedFlush:
    data: bytes
    decoded_bytes: int  # what reading it may decompress; goes into the manifest's FileEntry
    counts: list[tuple[str, int]]  # (param, changed) in flush order


def encode_flush(changes: Sequence[ParamChange], *, encoding: Encoding, version: int,
                 base_version: int | None, blocked: bool = True,
                 policy: blocks.Policy = blocks.Policy()) -> EncodedFlush:
    """Encode a bucket of changes; `blocked=False` writes the older `vllm-delta/1` layout."""
    if not blocked:
        return _encode_v1(changes, encoding=encoding, version=version, base_version=base_version)
    streams: dict[str, list[bytes]] = {}
    sizes: dict[str, int] = {}
    params = []
    compressed = encoding.compression != "none"
    for ch, d, numel, pos, new, old in _arrays(changes):
        names: list[str] | None = None
        rows = []
        width = 0 if pos is None else encoding.positions.width(pos, numel)  # one pass per param
        for first, a, b, parts in _blocks(ch, encoding, d, numel, pos, new, old, policy, width):
            names = names or list(parts)
            lengths = []
            for s in names:
                raw = parts[s]
                blob = container.compress(raw, encoding.zstd_level) if compressed and raw else raw
                streams.setdefault(s, []).append(blob)
                sizes[s] = sizes.get(s, 0) + len(raw)
                lengths += [len(blob), len(raw)]
            rows.append([first, first + b - a - 1 if pos is None else int(pos[b - 1]), b - a, lengths])
        params.append({"name": ch.name, "dtype": d.name, "shape": list(ch.shape), "count": len(new),
                       "width": width, "streams": names, "blocks": rows})
    meta = _header(encoding, version, base_version, FORMAT_BLOCKS, params,
                   {s: {"codec": "zstd" if compressed else "raw", "size": n} for s, n in sizes.items()})
    data = container.pack({f"__{s}__": b"".join(parts) for s, parts in streams.items()}, meta)
    return EncodedFlush(data, sum(sizes.values()) if compressed else 0, [(p["name"], p["count"]) for p in params])


def _blocks(ch: ParamChange, encoding: Encoding, d, numel: int, pos: np.ndarray | None, new: np.ndarray,
            old: np.ndarray | None, policy: blocks.Policy, width: int):
    """(first position, entry offset, end offset, streams) of each block of one param (`width`: the
    param-wide position width)."""
    if pos is None:  # implicit positions: dense blocks, value streams only
        for first, a, n in blocks.dense_cuts(ch.ranges, policy):
            yield first, a, a + n, encoding.encode_dense(new[a:a + n], None if old is None else old[a:a + n], d)
        return
    starts = blocks.cuts(pos, policy)
    for a, b in zip(starts, [*starts[1:], len(pos)]):
        _, parts = encoding.encode_param(pos[a:b], numel, new[a:b], None if old is None else old[a:b], d,
                                         prev=int(pos[a - 1]) if a else -1, width=width)
        yield int(pos[a]), a, b, parts


def _arrays(changes: Sequence[ParamChange], *, explicit: bool = False):
    """Host arrays of each change; `pos` is None for implicit positions unless `explicit`."""
    for ch in changes:
        d = by_torch(ch.new_values.dtype)
        numel = int(np.prod(ch.shape, dtype=np.int64))
        if ch.positions is not None:
            pos = ch.positions.detach().cpu().numpy().astype(np.int64, copy=False)
        elif explicit:  # `vllm-delta/1` has no implicit form
            pos = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in ch.ranges])
        else:
            pos = None
        new = to_bits(ch.new_values.detach().cpu().contiguous())
        old = None if ch.old_values is None else to_bits(ch.old_values.detach().cpu().contiguous())
        yield ch, d, numel, pos, new, old


def _header(encoding: Encoding, version: int, base_version: int | None, fmt: str, params: list,
            streams: dict) -> dict[str, str]:
    return {
        "format": fmt, "encoding": encoding.name, "current_version": str(version),
        "base_version": "" if base_version is None else str(base_version),
        "streams": json.dumps(streams), "params": json.dumps(params, separators=(",", ":")),
    }


def _encode_v1(changes: Sequence[ParamChange], *, encoding: Encoding, version: int,
               base_version: int | None) -> EncodedFlush:
    streams: dict[str, list[bytes]] = {}
    sizes: dict[str, int] = {}
    params = []
    for ch, d, numel, pos, new, old in _arrays(changes, explicit=True):
        width, parts = encoding.encode_param(pos, numel, new, old, d)
        spans = {}
        for s, blob in parts.items():
            start = sizes.get(s, 0)
            streams.setdefault(s, []).append(blob)
            sizes[s] = start + len(blob)
            spans[s] = [start, start + len(blob)]
        params.append({"name": ch.name, "dtype": d.name, "shape": list(ch.shape), "count": len(pos),
                       "width": width, "spans": spans})
    raw = {s: b"".join(parts) for s, parts in streams.items()}
    per_stream = encoding.compression == "streams"
    blobs = {f"__{s}__": container.compress(b, encoding.zstd_level) if per_stream else b for s, b in raw.items()}
    meta = _header(encoding, version, base_version, FORMAT, params,
                   {s: {"codec": "zstd" if per_stream else "raw", "size": len(b)} for s, b in raw.items()})
    data = container.pack(blobs, meta)
    decoded = sum(sizes.values()) if per_stream else 0
    if encoding.compression == "file":
        data, decoded = container.compress(data, encoding.zstd_level), len(data)
    return EncodedFlush(data, decoded, [(p["name"], p["count"]) for p in params])


# ---- decoding -----------------------------------------------------------------------------------

NonNeg = Annotated[int, Field(ge=0)]


class _StreamMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    codec: Literal["raw", "zstd"]
    size: NonNeg


class _ParamHead(BaseModel):
    """What both flush layouts say of a param."""

    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[NonNeg]
    count: Annotated[int, Field(ge=1)]
    width: NonNeg


class _ParamMeta(_ParamHead):
    spans: dict[str, tuple[NonNeg, NonNeg]]


class _BlockedParamMeta(_ParamHead):
    streams: list[str]
    blocks: list  # checked by blocks.parse_index (pydantic per element is slow on big indexes)


# The same schemas as slotted pydantic dataclasses: they validate the same input to the same
# fields, with half the cost an entry (1.1 vs 2.1 us: no model instance), but word some errors
# otherwise ("Unexpected keyword argument" for "Extra inputs are not permitted"). So the reader
# validates with these, and input they refuse goes through the models for the error it always
# gave (`_flush_params`); tests/wire/test_reader_per_tensor.py holds the two field for field.
_FAST = ConfigDict(extra="forbid")


@pydantic_dataclass(config=_FAST, slots=True)
class _FastParamHead:
    name: str
    dtype: str
    shape: list[NonNeg]
    count: Annotated[int, Field(ge=1)]
    width: NonNeg


@pydantic_dataclass(config=_FAST, slots=True)
class _FastParamMeta(_FastParamHead):
    spans: dict[str, tuple[NonNeg, NonNeg]]


@pydantic_dataclass(config=_FAST, slots=True)
class _FastBlockedParamMeta(_FastParamHead):
    streams: list[str]
    blocks: list


# One validation call per flush, not one per param.
_V1_LIST = TypeAdapter(list[_ParamMeta])
_BLOCKED_LIST = TypeAdapter(list[_BlockedParamMeta])
_FAST_LISTS = {_V1_LIST: TypeAdapter(list[_FastParamMeta]), _BLOCKED_LIST: TypeAdapter(list[_FastBlockedParamMeta])}


def _flush_params(adapter: TypeAdapter, params: object) -> list:
    """A flush's params validated by `adapter`'s schema, fast; refused input raises `adapter`'s own error."""
    try:
        return _FAST_LISTS[adapter].validate_python(params)
    except ValidationError:
        return adapter.validate_python(params)  # raises the error the reader has always raised


@dataclass(frozen=True)
class FlushHeader:
    encoding: str
    version: int
    base_version: int | None


def check_expected(name: str, shape: tuple[int, ...], dtype: torch.dtype, expected: Expected | None,
                   *, file: str | None) -> None:
    """The receiver's view of a param must match the delta's exactly."""
    if expected is None:
        return
    if name not in expected:
        raise UnknownParamError("param not in the model", file=file, param=name)
    want_shape, want_dtype = expected[name]
    if tuple(want_shape) != tuple(shape):
        raise ShapeMismatchError(f"shape {list(shape)} != model's {list(want_shape)}", file=file, param=name)
    if want_dtype != dtype:
        raise DtypeMismatchError(f"dtype {dtype} != model's {want_dtype}", file=file, param=name)


def open_flush(data: bytes | memoryview, *, file: str, limits: Limits, max_decoded: int | None = None,
               expected_hash: str | None = None):
    """Check the hash, undo whole-file zstd, parse the container: (tensors, metadata, budget left)."""
    if expected_hash is not None and bytes_digest(data) != expected_hash:
        raise IntegrityError("file hash does not match the manifest", file=file)
    budget = limits.max_decoded_bytes if max_decoded is None else min(max_decoded, limits.max_decoded_bytes)
    if bytes(data[:4]) == container.ZSTD_MAGIC:
        data = container.decompress(data, budget, file=file, what="file")
        budget -= len(data)
    tensors, meta = container.unpack(data, file=file, limits=limits)
    return tensors, meta, budget


def meta_json(meta: Mapping[str, str], key: str, *, file: str):
    try:
        return container.json_loads(meta[key])
    except (KeyError, json.JSONDecodeError):
        raise FormatError(f"metadata {key!r} is missing or not JSON", file=file) from None


def meta_int(meta: Mapping[str, str], key: str, *, file: str, optional: bool = False) -> int | None:
    v = meta.get(key)
    if optional and v in (None, ""):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise FormatError(f"metadata {key!r} is not an integer", file=file) from None


def decode_flush(tensors, meta: Mapping[str, str], budget: int, *, file: str,
                 expected: Expected | None = None, owned: Owned | None = None
                 ) -> tuple[FlushHeader, list[ParamDelta]]:
    """Decode an opened flush of this package's format; everything is validated before returning."""
    header, deltas = iter_flush(tensors, meta, budget, file=file, expected=expected, owned=owned)
    return header, list(deltas)


def iter_flush(tensors, meta: Mapping[str, str], budget: int, *, file: str, expected: Expected | None = None,
               owned: Owned | None = None, batches: bool = False
               ) -> tuple[FlushHeader, Iterator[ParamDelta | DeltaBatch]]:
    """Check a flush's metadata (and block index) now; decode its params one at a time as iterated.

    Why lazy: a receiver then holds one param's decoded changes at a time, not a flush's. Errors
    in a param's data are raised when that param is reached. With `owned`, a block-indexed
    flush decodes only the blocks of each param that meet its owned ranges. With `batches`, a run
    of params the batched decoder took whole comes as one `DeltaBatch`.
    """
    enc = get_encoding(meta.get("encoding", ""), file=file)
    header = FlushHeader(enc.name, meta_int(meta, "current_version", file=file),
                         meta_int(meta, "base_version", file=file, optional=True))
    blocked = meta.get("format") == FORMAT_BLOCKS
    with container.paused_gc():
        return _iter_flush(enc, header, blocked, tensors, meta, budget, file=file, expected=expected, owned=owned,
                           batches=batches)


def _iter_flush(enc: Encoding, header: FlushHeader, blocked: bool, tensors, meta: Mapping[str, str], budget: int, *,
                file: str, expected: Expected | None, owned: Owned | None, batches: bool = False
                ) -> tuple[FlushHeader, Iterator[ParamDelta | DeltaBatch]]:
    try:
        smeta = {k: _StreamMeta.model_validate(v) for k, v in meta_json(meta, "streams", file=file).items()}
        # A block-indexed flush's params as columns: read from the text where the writer wrote it, else
        # from the parsed JSON where the schema would take them as they are; else the schema decides.
        heads = params_columns.heads(meta.get("params")) if blocked else None
        pmeta = None
        if heads is None:
            raw = meta_json(meta, "params", file=file)
            heads = batch.Heads.of(raw) if blocked else None
            pmeta = None if heads is not None else _flush_params(_BLOCKED_LIST if blocked else _V1_LIST, raw)
            del raw
    except (ValidationError, AttributeError, TypeError) as e:
        raise FormatError(f"bad flush metadata: {e}", file=file) from None
    if sum(s.size for s in smeta.values() if s.codec == "zstd") > budget:
        raise LimitError("streams would decompress past the declared size", file=file)
    data: dict[str, memoryview] = {}
    for name, s in smeta.items():
        t = tensors.get(f"__{name}__")
        if t is None or t.dtype.st_code != "U8" or len(t.shape) != 1:
            raise FormatError(f"stream {name!r} missing or not a 1-D uint8 tensor", file=file)
        data[name] = t.data
    if blocked:
        return header, _iter_blocked(enc, smeta, data, pmeta, meta, file=file, expected=expected, owned=owned,
                                     batches=batches, heads=heads)
    return header, _iter_v1(enc, smeta, data, pmeta, file=file, expected=expected)


class _Heads:
    """A flush's param heads checked: `(dtype, shape, numel)` of each, made once per flush.

    Why a cache: what depends only on a head's dtype and shape (the dtype's name, the element
    count's bound) is the same for the thousands of expert tensors of one shape, so it is checked
    once per distinct head; the param's own checks (against the model, its change count) run for
    each, in the order `check_expected`, then the count, as they always have.
    """

    def __init__(self, expected: Expected | None, *, file: str) -> None:
        self.expected, self.file = expected, file
        self._known: dict[tuple[str, tuple[int, ...]], tuple] = {}

    def __call__(self, p) -> tuple:
        shape = tuple(p.shape)
        known = self._known.get((p.dtype, shape))
        d = by_name(p.dtype, file=self.file, param=p.name) if known is None else known[0]
        if self.expected is not None:
            want = self.expected.get(p.name)  # the common case in one comparison; else the precise check
            if want is None or want[1] != d.torch or type(want[0]) not in (tuple, torch.Size) or want[0] != shape:
                check_expected(p.name, shape, d.torch, self.expected, file=self.file)
        if known is None:
            numel = math.prod(shape)
            codecs.check_numel(numel, param=p.name)
            known = self._known[(p.dtype, shape)] = (d, shape, numel)
        if p.count > known[2]:
            raise FormatError(f"{p.count} changes in {known[2]} elements", file=self.file, param=p.name)
        return known


def _delta(enc: Encoding, name: str, shape, d, pos: np.ndarray, payload: np.ndarray, **extra) -> ParamDelta:
    values = (torch.from_numpy(np.ascontiguousarray(payload).view(f"<i{d.itemsize}")) if enc.needs_base
              else from_bits(payload, d))
    return ParamDelta(name, shape, d.torch, torch.from_numpy(pos), values, enc.needs_base, **extra)


def _iter_v1(enc: Encoding, smeta, data, pmeta, *, file: str, expected: Expected | None) -> Iterator[ParamDelta]:
    streams: dict[str, memoryview] = {}
    for name, s in smeta.items():
        if s.codec == "zstd":
            streams[name] = memoryview(container.decompress(data[name], s.size, exact=s.size, file=file, what=name))
        elif len(data[name]) != s.size:
            raise FormatError(f"stream {name!r}: {len(data[name])} B, declared {s.size} B", file=file)
        else:
            streams[name] = data[name]
    heads = _Heads(expected, file=file)
    shapes = [heads(p) for p in pmeta]
    for p in pmeta:
        for s, (a, b) in p.spans.items():
            if s not in streams or not a <= b <= len(streams[s]):
                raise FormatError(f"span of stream {s!r} out of bounds", file=file, param=p.name)
    for p, (d, shape, numel) in zip(pmeta, shapes):
        spans = {s: streams[s][a:b] for s, (a, b) in p.spans.items()}
        pos, payload = enc.decode_param(spans, p.count, p.width, numel, d, file=file, param=p.name)
        yield _delta(enc, p.name, shape, d, pos, payload)


def _iter_blocked(enc: Encoding, smeta, data, pmeta, meta: Mapping[str, str], *, file: str,
                  expected: Expected | None, owned: Owned | None, batches: bool = False,
                  heads: batch.Heads | None = None) -> Iterator[ParamDelta | DeltaBatch]:
    """Validate every param's block index against the streams, then decode lazily (see iter_flush).

    The batched path (wire/batch.py) first; whatever it does not take goes to the per-param path,
    from the param it stopped at, which raises the precise error if there is one. Once the batched
    path has its arrays, the parsed metadata (a few objects per param) is dropped, so it never
    lives long enough to make the garbage collector walk the whole heap; a fallback parses it again.
    """
    try:
        index = batch.parse(enc, smeta, data, heads or batch.Heads.of_models(pmeta), file=file, expected=expected)
    except batch.Fallback:
        if pmeta is None:  # the columns passed as the schema would: its entries, for the per-param path
            pmeta = _flush_params(_BLOCKED_LIST, meta_json(meta, "params", file=file))
        return _decode_blocked(enc, smeta, data, _plan_blocked(smeta, data, pmeta, file=file, expected=expected),
                               file=file, owned=owned)

    names, shapes, dtypes, needs_base = index.names, index.shapes, list(map(_TORCH, index.dtypes)), enc.needs_base

    def make(i: int, pos: torch.Tensor, values: torch.Tensor, skipped: int, bounds, nblocks) -> ParamDelta:
        return ParamDelta(names[i], shapes[i], dtypes[i], pos, values, needs_base, skipped, bounds, nblocks)

    def make_batch(p: int, q: int, pos, values, types, sizes, skipped, first, last, nblocks, nbytes: int
                   ) -> DeltaBatch:
        return DeltaBatch(names[p:q], shapes[p:q], dtypes[p:q], pos, values, types, sizes, needs_base,
                          index.count[p:q].tolist(), skipped, first, last, nblocks, nbytes)

    del pmeta, heads
    plans: list = []

    def fallback(i: int, j: int) -> Iterator[ParamDelta]:
        if not plans:
            with container.paused_gc():
                again = _flush_params(_BLOCKED_LIST, meta_json(meta, "params", file=file))
                plans.extend(_plan_blocked(smeta, data, again, file=file, expected=expected))
        return _decode_blocked(enc, smeta, data, plans[i:j], file=file, owned=owned)

    return batch.decode(enc, index, data, owned, make, fallback, make_batch if batches else None)


_TORCH = attrgetter("torch")


def _plan_blocked(smeta, data, pmeta, *, file: str, expected: Expected | None) -> list:
    """The per-param path's checks of every param's head and block index, and its decode plans."""
    cursor = {s: 0 for s in smeta}  # each stream holds the params' blocks back to back
    decoded = {s: 0 for s in smeta}
    plans = []
    heads = _Heads(expected, file=file)
    for p in pmeta:
        d, shape, numel = heads(p)
        if len(set(p.streams)) != len(p.streams) or any(s not in smeta for s in p.streams):
            raise FormatError(f"unknown or repeated streams {p.streams}", file=file, param=p.name)
        raw = [smeta[s].codec == "raw" for s in p.streams]
        index = blocks.parse_index(p.blocks, streams=len(p.streams), count=p.count, numel=numel,
                                   file=file, param=p.name, implicit=p.width == 0)
        if any(raw) and not np.array_equal(index.stored[:, raw], index.decoded[:, raw]):
            raise FormatError("raw block lengths differ from their decoded lengths", file=file, param=p.name)
        starts = {}
        for j, s in enumerate(p.streams):
            starts[s] = cursor[s]
            cursor[s] += int(index.stored[:, j].sum())
            decoded[s] += int(index.decoded[:, j].sum())
        plans.append((p, d, shape, numel, index, starts))
    for s, m in smeta.items():
        if cursor[s] != len(data[s]) or decoded[s] != m.size:
            raise FormatError(f"stream {s!r}: blocks span {cursor[s]} of {len(data[s])} B, decode to "
                              f"{decoded[s]} of the declared {m.size} B", file=file)
    return plans


def _decode_blocked(enc: Encoding, smeta, data, plans, *, file: str, owned: Owned | None) -> Iterator[ParamDelta]:
    for p, d, shape, numel, index, starts in plans:
        ranges = None if owned is None else owned.get(p.name)
        mask = blocks.wanted(index, None if ranges is None else blocks.merge(ranges))
        offsets = [starts[s] + np.concatenate(([0], np.cumsum(index.stored[:, j]))) for j, s in enumerate(p.streams)]

        def spans(k: int, m: int) -> dict[str, memoryview]:
            return {s: _run_bytes(data[s], smeta[s].codec, offsets[j], index, j, k, m, file=file, param=p.name)
                    for j, s in enumerate(p.streams)}

        if p.width == 0:  # implicit positions: each dense block on its own (counts need not be x8)
            parts = [enc.decode_dense(spans(k, k + 1), int(index.first[k]), int(index.last[k]), d, file=file,
                                      param=p.name) for k in np.flatnonzero(mask).tolist()]
        else:
            parts = [_decode_run(enc, p, d, numel, index, k, m, spans(k, m), file=file) for k, m in blocks.runs(mask)]
        pos = np.concatenate([x for x, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
        payload = np.concatenate([v for _, v in parts]) if parts else np.zeros(0, dtype=d.uint)
        yield _delta(enc, p.name, shape, d, pos, payload, skipped=p.count - pos.size,
                     bounds=(int(index.first[0]), int(index.last[-1])), blocks=(int(mask.sum()), index.size))


def _decode_run(enc: Encoding, p, d, numel: int, index: BlockIndex, k: int, m: int, spans, *, file: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """Blocks k..m-1 of explicit positions, decoded as one: gaps continue across blocks."""
    counts = index.count[k:m]
    pos, payload = enc.decode_param(spans, int(counts.sum()), p.width, numel, d,
                                    prev=int(index.last[k - 1]) if k else -1, file=file, param=p.name)
    heads = np.cumsum(counts) - counts
    if not (np.array_equal(pos[heads], index.first[k:m]) and np.array_equal(pos[heads + counts - 1],
                                                                            index.last[k:m])):
        raise BoundsError("positions disagree with the block index", file=file, param=p.name)
    return pos, payload


def _run_bytes(stream: memoryview, codec: str, offsets: np.ndarray, index: BlockIndex, j: int, k: int, m: int, *,
               file: str, param: str) -> memoryview:
    """Decoded bytes of stream column `j` for blocks k..m-1 (`offsets`: the blocks' byte offsets in the
    stream, and its end), in one buffer of exactly their size."""
    a, b = int(offsets[k]), int(offsets[m])
    if codec == "raw":
        return stream[a:b]
    sizes = index.decoded[k:m, j]
    if m - k == 1 and sizes[0]:
        return memoryview(container.decompress(stream[a:b], int(sizes[0]), exact=int(sizes[0]), file=file,
                                               what=f"block {k} of stream {j}", param=param))
    out = bytearray(int(sizes.sum()))
    at = 0
    for i, n in zip(range(k, m), sizes.tolist()):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if hi == lo:
            if n:
                raise FormatError(f"block {i} of stream {j} is empty but decodes to {n} B", file=file, param=param)
            continue
        out[at:at + n] = container.decompress(stream[lo:hi], n, exact=n, file=file, what=f"block {i} of stream {j}",
                                              param=param)
        at += n
    return memoryview(out)
