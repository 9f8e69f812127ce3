"""The registry of encodings: each pairs a position codec with a value codec and says how the flush is
compressed (not at all, the whole file, or each stream on its own, so each gets its own entropy tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .codecs import (
    GAP_WIDTHS,
    _frombuffer,
    check_positions,
    decode_gaps,
    encode_gaps,
    from_planes,
    gap_width,
    to_planes,
    ulp_streams,
)
from .errors import BoundsError, FormatError, UnknownEncodingError

Streams = dict[str, bytes]
Spans = dict[str, memoryview]


def _need(spans: Spans, name: str, *, file, param) -> memoryview:
    if name not in spans:
        raise FormatError(f"missing stream {name!r}", file=file, param=param)
    return spans[name]


def _planes(spans: Spans, prefix: str, width: int, *, file, param) -> list[memoryview]:
    return [_need(spans, f"{prefix}{j}", file=file, param=param) for j in range(width)]


def _streams(arr: np.ndarray, planes: bool, prefix: str, name: str) -> Streams:
    """`arr` as one stream `name`, or as byte planes `prefix0..`."""
    return {f"{prefix}{j}": p for j, p in enumerate(to_planes(arr))} if planes else {name: arr.tobytes()}


def _words(spans: Spans, planes: bool, prefix: str, name: str, count: int, width: int, what: str, **at):
    """`_streams`' inverse: `count` unsigned words of `width` bytes."""
    if planes:
        return from_planes(_planes(spans, prefix, width, **at), count, width, what, **at)
    return _frombuffer(_need(spans, name, **at), np.dtype(f"<u{width}"), count, what, **at)


class Indices:
    """Absolute flat positions, int32 or int64 past 2^31 elements. Position codecs: `prev` is the position
    before the first (-1 at a param's start); `width` is param-wide, so a param's blocks concatenate."""

    planes = False

    def width(self, pos, numel):
        return 4 if numel <= 1 << 31 else 8

    def encode(self, pos, numel, *, prev=-1, width=None):
        w = self.width(pos, numel)
        return w, {"positions": pos.astype(f"<i{w}").tobytes()}

    def decode(self, spans, count, width, numel, *, prev=-1, file, param):
        if width not in (4, 8):
            raise FormatError(f"index width {width} is not 4 or 8", file=file, param=param)
        buf = _need(spans, "positions", file=file, param=param)
        pos = _frombuffer(buf, np.dtype(f"<i{width}"), count, "positions", file=file, param=param)
        pos = pos.astype(np.int64)
        check_positions(pos, numel, file=file, param=param)
        if pos.size and pos[0] <= prev:
            raise BoundsError("positions are not strictly increasing", file=file, param=param)
        return pos


@dataclass(frozen=True)
class Gaps:
    """Gaps in one narrow-int stream `positions` (the seed's `deltas`), or with `planes` in byte planes
    `pos0..pos7` (the low plane carries the information)."""

    planes: bool

    def width(self, pos, numel):
        return gap_width(pos)

    def encode(self, pos, numel, *, prev=-1, width=None):
        w, gaps = encode_gaps(pos, prev=prev, width=width)
        return w, _streams(gaps, self.planes, "pos", "positions")

    def decode(self, spans, count, width, numel, *, prev=-1, file, param):
        if width not in GAP_WIDTHS:
            raise FormatError(f"gap width {width} is not one of {GAP_WIDTHS}", file=file, param=param)
        gaps = _words(spans, self.planes, "pos", "positions", count, width, "gaps", file=file, param=param)
        return decode_gaps(gaps, numel, prev=prev, file=file, param=param)


@dataclass(frozen=True)
class Values:
    """New bit patterns in the param's own dtype: one stream `values`, or with `planes` byte planes
    `val0..` (exponent bytes repeat, mantissas do not)."""

    planes: bool
    relative = False

    def encode(self, new, old, d):
        return _streams(new, self.planes, "val", "values")

    def decode(self, spans, count, d, *, file, param):
        out = _words(spans, self.planes, "val", "values", count, d.itemsize, "values", file=file, param=param)
        return out if self.planes else out.copy()


class UlpSteps:
    """Signed ULP steps from the old value: packed `sign`, packed `flag` (|step|>1), planes `esc0..`;
    decoded to wrapping unsigned steps the receiver resolves against its own bits."""

    relative = True
    planes = True

    def encode(self, new, old, d):
        return ulp_streams(new, old, d)

    def decode(self, spans, count, d, *, file, param):
        at = {"file": file, "param": param}
        neg, big = (
            np.unpackbits(
                _words(spans, False, "", s, (count + 7) // 8, 1, f"{s}s", **at), count=count
            ).astype(bool)
            for s in ("sign", "flag")
        )
        planes = _planes(spans, "esc", d.itemsize, file=file, param=param)
        mag = np.ones(count, dtype=d.uint)
        mag[big] = from_planes(planes, int(big.sum()), d.itemsize, "escapes", file=file, param=param) + 2
        return np.where(neg, d.uint.type(0) - mag, mag)


@dataclass(frozen=True)
class Encoding:
    """One named way to put a param's changes on the wire."""

    name: str
    positions: Indices | Gaps
    values: Values | UlpSteps
    compression: Literal["none", "file", "streams"]
    description: str
    zstd_level: int = 1

    @property
    def needs_base(self) -> bool:
        """Values are relative to the receiver's current bits: apply exactly once, on base_version."""
        return self.values.relative

    @property
    def idempotent(self) -> bool:
        return not self.values.relative

    def describe(self) -> dict:
        return {
            "name": self.name,
            "idempotent": self.idempotent,
            "needs_base": self.needs_base,
            "compression": self.compression,
            "description": self.description,
        }


ENCODINGS: dict[str, Encoding] = {
    e.name: e
    for e in (
        Encoding(
            "indices",
            Indices(),
            Values(planes=False),
            "none",
            "seed-compatible: absolute int32 positions (int64 past 2^31 elements), raw values",
        ),
        Encoding(
            "deltas",
            Gaps(planes=False),
            Values(planes=False),
            "none",
            "seed-compatible: gaps idx[k]-idx[k-1]-1 in the narrowest of u8/u16/u32/u64, raw values",
        ),
        Encoding(
            "deltas_zstd",
            Gaps(planes=False),
            Values(planes=False),
            "file",
            "seed-compatible: `deltas` with the whole file zstd-1 compressed",
        ),
        Encoding(
            "planes_zstd",
            Gaps(planes=True),
            Values(planes=True),
            "streams",
            "overwrite: gap and value byte planes, each plane its own zstd stream",
        ),
        Encoding(
            "ulp_zstd",
            Gaps(planes=True),
            UlpSteps(),
            "streams",
            "base-relative: gap byte planes + signed ULP steps from the old bits, zstd per stream",
        ),
    )
}

DEFAULT_ENCODING = "ulp_zstd"


def get_encoding(name: str, *, file: str | None = None) -> Encoding:
    enc = ENCODINGS.get(name)
    if enc is None:
        raise UnknownEncodingError(f"unknown encoding {name!r}", file=file)
    return enc
