"""A flush's metadata (docs/wire-format.md): its formats, header, streams and the one parser of its
`params`, read as columns (`Heads`) checked in a few set and type passes (an object a param was most of
the reader's cost at 44k tensors); only input they refuse is walked entry by entry, naming the first
param at fault."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from itertools import chain
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import torch

from vllm_delta.kernels import switch

from .codecs import check_numel
from .container import json_loads
from .dtypes import by_name
from .errors import DtypeMismatchError, FormatError, ShapeMismatchError, UnknownParamError
from .manifest import FORMAT

FORMAT_BLOCKS = "vllm-delta/2"  # flush header format of block-indexed flushes
FLUSH_FORMATS = (FORMAT, FORMAT_BLOCKS)
CODECS = ("raw", "zstd")

Expected = Mapping[str, tuple[Sequence[int], torch.dtype]]

_HEAD = ("name", "dtype", "shape", "count", "width")
_ROW_HEAD, _ROW_FRAMES = itemgetter(0, 1, 2), itemgetter(3)  # a block row's [first, last, count], its lengths
BLOCKED_FIELDS = (*_HEAD, "streams", "blocks")
V1_FIELDS = (*_HEAD, "spans")


@dataclass(frozen=True)
class FlushHeader:
    encoding: str
    version: int
    base_version: int | None


@dataclass(frozen=True)
class StreamMeta:
    codec: str  # one of CODECS
    size: int  # decoded bytes


class Param(NamedTuple):
    """One param's entry (the per-param decode paths' view of `Heads`)."""

    name: str
    dtype: str
    shape: list
    count: int  # type: ignore[assignment]  # a field named like tuple.count, read as `p.count`
    width: int
    streams: list
    blocks: list
    spans: dict


@dataclass
class Heads:
    """A flush's `params` as columns, one tuple a field, in flush order; a `vllm-delta/1` flush has
    `spans` and empty `streams`/`blocks`, a block-indexed one the reverse."""

    name: tuple
    dtype: tuple
    shape: tuple
    count: tuple
    width: tuple
    streams: tuple
    blocks: tuple
    spans: tuple = ()
    # the block rows already as arrays (`heads_from_text`): `blocks` unused
    rows: Rows | None = dc_field(default=None, kw_only=True)

    def entries(self) -> list[Param]:
        n = len(self.name)
        rest: tuple = (self.streams or [[]] * n, self.blocks or [[]] * n, self.spans or [{}] * n)
        return list(map(Param._make, zip(self.name, self.dtype, self.shape, self.count, self.width, *rest)))


@dataclass
class Rows:
    """Every param's block index rows as arrays, in flush order (each row `[first, last, count, [stored,
    decoded, ...]]` in the JSON)."""

    nrows: np.ndarray  # int64 [params]: rows of each param
    head: np.ndarray  # int64 [rows, 3]: first, last, count
    frames: np.ndarray  # int64 [rows]: frame lengths each row lists (stored and decoded per stream)
    lens: np.ndarray  # int64: those lengths, row after row

    @classmethod
    def of(cls, lists: tuple) -> Rows | None:
        """From the parsed JSON's `blocks` lists, checked as sets; or None (for the per-param path)."""
        nrows = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        rows = list(chain.from_iterable(lists))
        if not set(map(type, rows)) <= {list} or not set(map(len, rows)) <= {4}:
            return None
        frames = list(map(_ROW_FRAMES, rows))
        if not set(map(type, frames)) <= {list}:
            return None
        heads = list(chain.from_iterable(map(_ROW_HEAD, rows)))
        lens = list(chain.from_iterable(frames))
        if not set(map(type, heads)) <= {int} or not set(map(type, lens)) <= {int}:
            return None
        try:
            head = np.array(heads, dtype=np.int64).reshape(-1, 3)
            flat = np.array(lens, dtype=np.int64)
        except (ValueError, OverflowError):
            return None
        return cls(nrows, head, np.fromiter(map(len, frames), dtype=np.int64, count=len(rows)), flat)


def meta_json(meta: Mapping[str, str], key: str, *, file: str):
    try:
        return json_loads(meta[key])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise FormatError(f"metadata {key!r} is missing or not JSON", file=file) from None


def meta_int(meta: Mapping[str, str], key: str, *, file: str) -> int:
    try:
        return int(meta.get(key, ""))
    except (TypeError, ValueError):
        raise FormatError(f"metadata {key!r} is not an integer", file=file) from None


def parse_streams(meta: Mapping[str, str], *, file: str) -> dict[str, StreamMeta]:
    raw = meta_json(meta, "streams", file=file)
    if type(raw) is not dict:
        raise FormatError("bad flush metadata: streams is not an object", file=file)
    out = {}
    for name, s in raw.items():
        if (
            type(s) is not dict
            or set(s) != {"codec", "size"}
            or s["codec"] not in CODECS
            or type(s["size"]) is not int
            or s["size"] < 0
        ):
            want = "{codec: raw|zstd, size: int >= 0}"
            raise FormatError(f"bad flush metadata: stream {name!r} is not {want}", file=file)
        out[name] = StreamMeta(s["codec"], s["size"])
    return out


def parse_params(raw: object, *, blocked: bool, file: str) -> Heads:
    """A flush's params (parsed JSON) as columns, checked; else `FormatError` naming the first bad one."""
    fields = BLOCKED_FIELDS if blocked else V1_FIELDS
    if type(raw) is not list:
        raise FormatError("bad flush metadata: params is not a list", file=file)
    if not raw:
        return Heads((), (), (), (), (), (), (), ())
    if set(map(type, raw)) == {dict} and set(map(len, raw)) == {len(fields)}:
        try:
            columns = list(zip(*map(itemgetter(*fields), raw)))
        except KeyError:
            columns = None
        if columns is not None and _columns_ok(columns, blocked):
            return Heads(*columns) if blocked else Heads(*columns[:5] + [(), (), columns[5]])
    for i, p in enumerate(raw):  # the precise error
        _check_entry(i, p, fields, file=file)
    raise AssertionError("the column checks refused what every entry's check takes")  # pragma: no cover


def _columns_ok(columns: list[tuple], blocked: bool) -> bool:
    """The entry checks of `_check_entry`, as a few passes over whole columns."""
    name, dtype, shape, count, width = columns[:5]
    dims = list(chain.from_iterable(shape)) if set(map(type, shape)) == {list} else None
    if (
        dims is None
        or not set(map(type, name)) | set(map(type, dtype)) == {str}
        or not set(map(type, dims)) <= {int}
        or (dims and min(dims) < 0)
        or set(map(type, count)) | set(map(type, width)) != {int}
        or min(count) < 1
        or min(width) < 0
    ):
        return False
    if blocked:
        streams, blocks = columns[5:]
        return set(map(type, streams)) | set(map(type, blocks)) == {list} and set(
            map(type, chain.from_iterable(streams))
        ) <= {str}
    return all(map(_spans_ok, columns[5]))


def _spans_ok(spans: object) -> bool:
    return type(spans) is dict and all(
        type(ab) is list and len(ab) == 2 and _nonneg_int(ab[0]) and _nonneg_int(ab[1])
        for ab in spans.values()
    )


def _nonneg_int(x: object, least: int = 0) -> bool:
    return type(x) is int and x >= least


_RULES = {
    "name": (lambda v: type(v) is str, "a string"),
    "dtype": (lambda v: type(v) is str, "a string"),
    "shape": (lambda v: type(v) is list and all(map(_nonneg_int, v)), "a list of ints >= 0"),
    "count": (lambda v: _nonneg_int(v, 1), "an int >= 1"),
    "width": (_nonneg_int, "an int >= 0"),
    "streams": (lambda v: type(v) is list and all(type(s) is str for s in v), "a list of strings"),
    "blocks": (lambda v: type(v) is list, "a list"),
    "spans": (_spans_ok, "an object of [start, end] pairs of ints >= 0"),
}


def _check_entry(i: int, p: object, fields: tuple[str, ...], *, file: str) -> None:
    if type(p) is not dict:
        raise FormatError(f"bad flush metadata: params[{i}] is not an object", file=file)
    param = p.get("name") if type(p.get("name")) is str else None
    missing = [f for f in fields if f not in p]
    extra = [f for f in p if f not in fields]
    if missing or extra:
        what = f"lacks fields {missing}" if missing else f"has unknown fields {extra}"
        raise FormatError(f"bad flush metadata: params[{i}] {what}", file=file, param=param)
    for f in fields:
        ok, want = _RULES[f]
        if not ok(p[f]):
            raise FormatError(f"bad flush metadata: params[{i}].{f} is not {want}", file=file, param=param)


def heads_from_text(text: object) -> Heads | None:
    """A block-indexed flush's `params` columns read from the writer's text by one compiled scan, or None
    (anything else, or kernels off: `parse_params` reads it). Why: JSON makes ~17 objects a tensor, 34 vs
    26 us a tensor of prepare at 44k tensors (benchmarks/reader_per_tensor.py, medians of 3)."""
    if type(text) is not str or not switch.on():
        return None
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        return None
    from vllm_delta.kernels import params_jit as pj  # numba: on first use

    n, nrows, nframes, spans, distinct, counts, head, frame_at, lens = pj.scan(
        np.frombuffer(raw, dtype=np.uint8), pj.KEYS
    )
    if n < 1:
        return None
    texts = [[text[a:b] for a, b in distinct[field, : counts[field]].tolist()] for field in range(3)]
    dtypes, shapes, streams = texts[0], _lists(texts[1]), _lists(texts[2])
    if shapes is None or streams is None:
        return None
    cols = spans[:n].T.tolist()
    count, width = tuple(cols[pj.COUNT]), tuple(cols[pj.WIDTH])
    # parse_params's bounds (its types hold by the scan: ints, strings, lists of them).
    if min(count) < 1 or min(width) < 0 or min(map(min, filter(None, shapes)), default=0) < 0:
        return None
    return Heads(
        tuple(map(text.__getitem__, map(slice, cols[pj.NAME_A], cols[pj.NAME_B]))),
        tuple(map(dtypes.__getitem__, cols[pj.DTYPE])),
        tuple(map(shapes.__getitem__, cols[pj.SHAPE])),
        count,
        width,
        tuple(map(streams.__getitem__, cols[pj.STREAMS])),
        (),
        rows=Rows(
            spans[:n, pj.NROWS].copy(),
            head[:nrows].copy(),
            np.diff(frame_at[: nrows + 1]),
            lens[:nframes].copy(),
        ),
    )


def _lists(texts: list[str]) -> list[tuple] | None:
    """Each distinct text's JSON list as a tuple: one object for all its params."""
    values = list(map(json_loads, texts))
    return list(map(tuple, values)) if all(type(v) is list for v in values) else None


class HeadCheck:
    """Param heads checked: `(dtype, shape, numel)` of each. Why a cache: what depends only on a head's
    dtype and shape is the same for the thousands of expert tensors of one shape, so it is checked once;
    each param is checked against the model (`check_expected`), then its change count."""

    def __init__(self, expected: Expected | None, *, file: str) -> None:
        self.expected, self.file = expected, file
        self._known: dict[tuple[str, tuple[int, ...]], tuple] = {}

    def __call__(self, name: str, dtype: str, shape: Sequence[int], count: int = 0) -> tuple:
        shape = tuple(shape)
        known = self._known.get((dtype, shape))
        d = by_name(dtype, file=self.file, param=name) if known is None else known[0]
        check_expected(name, shape, d.torch, self.expected, file=self.file)
        if known is None:
            numel = math.prod(shape)
            check_numel(numel, param=name)
            known = self._known[(dtype, shape)] = (d, shape, numel)
        if count > known[2]:
            raise FormatError(f"{count} changes in {known[2]} elements", file=self.file, param=name)
        return known


def check_expected(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, expected: Expected | None, *, file: str
) -> None:
    """The receiver's view of a param must match the delta's exactly."""
    if expected is None:
        return
    if name not in expected:
        raise UnknownParamError("param not in the model", file=file, param=name)
    want_shape, want_dtype = expected[name]
    if tuple(want_shape) != shape:
        raise ShapeMismatchError(f"shape {list(shape)} != model's {list(want_shape)}", file=file, param=name)
    if want_dtype != dtype:
        raise DtypeMismatchError(f"dtype {dtype} != model's {want_dtype}", file=file, param=name)
