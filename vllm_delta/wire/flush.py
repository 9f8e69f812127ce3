"""One flush: a bucket of param changes as one safetensors byte string.

The same bytes are a file on disk or a buffer broadcast over a collective. Layout: one 1-D uint8
tensor `__<stream>__` per stream, and metadata `format`, `encoding`, `current_version`,
`base_version`, `streams` (JSON: codec and decoded size per stream) and `params` (JSON: name,
dtype, shape, count, width and byte spans per stream, in decoded streams).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import codecs, container
from .container import Limits
from .digest import bytes_digest
from .dtypes import by_name, by_torch, from_bits, to_bits
from .encodings import Encoding, get_encoding
from .errors import (DtypeMismatchError, FormatError, IntegrityError, LimitError,
                     ShapeMismatchError, UnknownParamError)
from .manifest import FORMAT

Expected = Mapping[str, tuple[Sequence[int], torch.dtype]]


@dataclass(frozen=True, eq=False)
class ParamChange:
    """Sender side: the changes of one param (or one chunk of it)."""

    name: str
    shape: tuple[int, ...]
    positions: torch.Tensor  # int64, sorted, unique
    new_values: torch.Tensor  # the param's own dtype
    old_values: torch.Tensor | None = None  # needed by base-relative encodings


@dataclass(frozen=True, eq=False)
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

    @property
    def count(self) -> int:
        return self.positions.numel()

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


@dataclass(frozen=True)
class EncodedFlush:
    data: bytes
    decoded_bytes: int  # what reading it may decompress; goes into the manifest's FileEntry
    counts: list[tuple[str, int]]  # (param, changed) in flush order


def encode_flush(changes: Sequence[ParamChange], *, encoding: Encoding, version: int,
                 base_version: int | None) -> EncodedFlush:
    streams: dict[str, list[bytes]] = {}
    sizes: dict[str, int] = {}
    params = []
    for ch in changes:
        d = by_torch(ch.new_values.dtype)
        numel = int(np.prod(ch.shape, dtype=np.int64))
        pos = ch.positions.detach().cpu().numpy().astype(np.int64, copy=False)
        new = to_bits(ch.new_values.detach().cpu().contiguous())
        old = None if ch.old_values is None else to_bits(ch.old_values.detach().cpu().contiguous())
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
    meta = {
        "format": FORMAT, "encoding": encoding.name, "current_version": str(version),
        "base_version": "" if base_version is None else str(base_version),
        "streams": json.dumps({s: {"codec": "zstd" if per_stream else "raw", "size": len(b)}
                               for s, b in raw.items()}),
        "params": json.dumps(params, separators=(",", ":")),
    }
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


class _ParamMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[NonNeg]
    count: Annotated[int, Field(ge=1)]
    width: NonNeg
    spans: dict[str, tuple[NonNeg, NonNeg]]


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
        return json.loads(meta[key])
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
                 expected: Expected | None = None) -> tuple[FlushHeader, list[ParamDelta]]:
    """Decode an opened flush of this package's format; everything is validated before returning."""
    enc = get_encoding(meta.get("encoding", ""), file=file)
    header = FlushHeader(enc.name, meta_int(meta, "current_version", file=file),
                         meta_int(meta, "base_version", file=file, optional=True))
    try:
        smeta = {k: _StreamMeta.model_validate(v) for k, v in meta_json(meta, "streams", file=file).items()}
        pmeta = [_ParamMeta.model_validate(p) for p in meta_json(meta, "params", file=file)]
    except (ValidationError, AttributeError, TypeError) as e:
        raise FormatError(f"bad flush metadata: {e}", file=file) from None
    if sum(s.size for s in smeta.values() if s.codec == "zstd") > budget:
        raise LimitError("streams would decompress past the declared size", file=file)
    streams: dict[str, memoryview] = {}
    for name, s in smeta.items():
        t = tensors.get(f"__{name}__")
        if t is None or t.dtype.st_code != "U8" or len(t.shape) != 1:
            raise FormatError(f"stream {name!r} missing or not a 1-D uint8 tensor", file=file)
        if s.codec == "zstd":
            streams[name] = memoryview(container.decompress(t.data, s.size, exact=s.size, file=file, what=name))
        elif len(t.data) != s.size:
            raise FormatError(f"stream {name!r}: {len(t.data)} B, declared {s.size} B", file=file)
        else:
            streams[name] = t.data
    out = []
    for p in pmeta:
        d = by_name(p.dtype, file=file, param=p.name)
        shape = tuple(p.shape)
        check_expected(p.name, shape, d.torch, expected, file=file)
        numel = int(np.prod(shape, dtype=object))
        codecs.check_numel(numel, param=p.name)
        spans = {}
        for s, (a, b) in p.spans.items():
            if s not in streams or not a <= b <= len(streams[s]):
                raise FormatError(f"span of stream {s!r} out of bounds", file=file, param=p.name)
            spans[s] = streams[s][a:b]
        if p.count > numel:
            raise FormatError(f"{p.count} changes in {numel} elements", file=file, param=p.name)
        pos, payload = enc.decode_param(spans, p.count, p.width, numel, d, file=file, param=p.name)
        values = (torch.from_numpy(np.ascontiguousarray(payload).view(f"<i{d.itemsize}")) if enc.needs_base
                  else from_bits(payload, d))
        out.append(ParamDelta(p.name, shape, d.torch, torch.from_numpy(pos), values, enc.needs_base))
    return header, out
