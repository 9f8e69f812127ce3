"""The registry of encodings: each pairs a position codec with a value codec and says how the flush is
compressed (not at all, the whole file, or each stream on its own, so each gets its own entropy tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .codecs import (
    GAP_WIDTHS,
    _frombuffer,
    decode_gaps,
    decode_indices,
    encode_gaps,
    from_planes,
    gap_width,
    gaps_from_bytes,
    to_planes,
    ulp_streams,
    unpack_bits,
)
from .dtypes import DType
from .errors import FormatError, UnknownEncodingError

Streams = dict[str, bytes]
Spans = dict[str, memoryview]


def _need(spans: Spans, name: str, *, file, param) -> memoryview:
    if name not in spans:
        raise FormatError(f"missing stream {name!r}", file=file, param=param)
    return spans[name]


def _planes(spans: Spans, prefix: str, width: int, *, file, param) -> list[memoryview]:
    return [_need(spans, f"{prefix}{j}", file=file, param=param) for j in range(width)]


class Indices:
    """Absolute flat positions, int32 or int64 past 2^31 elements. Position codecs: `prev` is the position
    before the first (-1 at a param's start); `width` is param-wide, so a param's blocks concatenate."""

    def width(self, pos, numel):
        return 4 if numel <= 1 << 31 else 8

    def encode(self, pos, numel, *, prev=-1, width=None):
        w = self.width(pos, numel)
        return w, {"positions": pos.astype(f"<i{w}").tobytes()}

    def decode(self, spans, count, width, numel, *, prev=-1, file, param):
        buf = _need(spans, "positions", file=file, param=param)
        return decode_indices(buf, count, width, numel, prev=prev, file=file, param=param)


class Gaps:
    """Gaps in one contiguous narrow-int stream (the seed's `deltas`)."""

    def width(self, pos, numel):
        return gap_width(pos)

    def encode(self, pos, numel, *, prev=-1, width=None):
        w, gaps = encode_gaps(pos, prev=prev, width=width)
        return w, {"positions": gaps.tobytes()}

    def decode(self, spans, count, width, numel, *, prev=-1, file, param):
        buf = _need(spans, "positions", file=file, param=param)
        gaps = gaps_from_bytes(buf, count, width, file=file, param=param)
        return decode_gaps(gaps, numel, prev=prev, file=file, param=param)


class GapPlanes:
    """Gaps split into byte planes `pos0..pos7`: the low plane carries the information."""

    def width(self, pos, numel):
        return gap_width(pos)

    def encode(self, pos, numel, *, prev=-1, width=None):
        w, gaps = encode_gaps(pos, prev=prev, width=width)
        return w, {f"pos{j}": p for j, p in enumerate(to_planes(gaps))}

    def decode(self, spans, count, width, numel, *, prev=-1, file, param):
        if width not in GAP_WIDTHS:
            raise FormatError(f"gap width {width} is not one of {GAP_WIDTHS}", file=file, param=param)
        planes = _planes(spans, "pos", width, file=file, param=param)
        gaps = from_planes(planes, count, width, "gaps", file=file, param=param)
        return decode_gaps(gaps, numel, prev=prev, file=file, param=param)


class RawValues:
    """New bit patterns, contiguous, in the param's own dtype."""

    relative = False

    def encode(self, new, old, d):
        return {"values": new.tobytes()}

    def decode(self, spans, count, d, *, file, param):
        buf = _need(spans, "values", file=file, param=param)
        return _frombuffer(buf, d.uint, count, "values", file=file, param=param).copy()


class ValuePlanes:
    """New bit patterns split into byte planes `val0..`: exponent bytes repeat, mantissas do not."""

    relative = False

    def encode(self, new, old, d):
        return {f"val{j}": p for j, p in enumerate(to_planes(new))}

    def decode(self, spans, count, d, *, file, param):
        planes = _planes(spans, "val", d.itemsize, file=file, param=param)
        return from_planes(planes, count, d.itemsize, "values", file=file, param=param)


class UlpSteps:
    """Signed ULP steps from the old value: packed `sign`, packed `flag` (|step|>1), planes `esc0..`;
    decoded to wrapping unsigned steps the receiver resolves against its own bits."""

    relative = True

    def encode(self, new, old, d):
        return ulp_streams(new, old, d)

    def decode(self, spans, count, d, *, file, param):
        neg, big = (
            unpack_bits(_need(spans, s, file=file, param=param), count, f"{s}s", file=file, param=param)
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
    positions: Indices | Gaps | GapPlanes
    values: RawValues | ValuePlanes | UlpSteps
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

    def encode_param(
        self,
        pos: np.ndarray,
        numel: int,
        new: np.ndarray,
        old: np.ndarray | None,
        d: DType,
        *,
        prev: int = -1,
        width: int | None = None,
    ) -> tuple[int, Streams]:
        """Streams of one param, or of one block of it (`prev`, `width`: see `Indices`)."""
        width, streams = self.positions.encode(pos, numel, prev=prev, width=width)
        if self.needs_base and old is None:
            raise ValueError(f"encoding {self.name!r} needs the old values")
        streams.update(self.values.encode(new, old, d))
        return width, streams

    def decode_param(
        self,
        spans: Spans,
        count: int,
        width: int,
        numel: int,
        d: DType,
        *,
        prev: int = -1,
        file: str | None,
        param: str | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Positions (int64, validated) and the value payload (new bits, or steps if needs_base)."""
        pos = self.positions.decode(spans, count, width, numel, prev=prev, file=file, param=param)
        return pos, self.values.decode(spans, count, d, file=file, param=param)

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
            RawValues(),
            "none",
            "seed-compatible: absolute int32 positions (int64 past 2^31 elements), raw values",
        ),
        Encoding(
            "deltas",
            Gaps(),
            RawValues(),
            "none",
            "seed-compatible: gaps idx[k]-idx[k-1]-1 in the narrowest of u8/u16/u32/u64, raw values",
        ),
        Encoding(
            "deltas_zstd",
            Gaps(),
            RawValues(),
            "file",
            "seed-compatible: `deltas` with the whole file zstd-1 compressed",
        ),
        Encoding(
            "planes_zstd",
            GapPlanes(),
            ValuePlanes(),
            "streams",
            "overwrite: gap and value byte planes, each plane its own zstd stream",
        ),
        Encoding(
            "ulp_zstd",
            GapPlanes(),
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
