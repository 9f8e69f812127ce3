"""Bounded reading and writing of the two byte-level layers: safetensors and zstd.

Written with the `safetensors` library; read with a strict parser of the safetensors layout, so
that a header size, every offset and every decompressed size is checked against a limit before
any allocation happens.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass

import numpy as np
import safetensors.numpy
import zstandard

from .dtypes import DType, by_st_code
from .errors import FormatError, LimitError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class Limits:
    """Caps for untrusted input. Manifest-declared sizes tighten these; they never loosen them."""

    max_header_bytes: int = 64 << 20
    max_manifest_bytes: int = 128 << 20
    # Decompression cap when no manifest says better (seed deltas).
    max_decoded_bytes: int = 4 << 30


@dataclass(frozen=True)
class RawTensor:
    dtype: DType
    shape: tuple[int, ...]
    data: memoryview


def pack(blobs: dict[str, bytes], metadata: dict[str, str]) -> bytes:
    """A safetensors file of 1-D uint8 tensors."""
    arrays = {k: np.frombuffer(v, dtype=np.uint8) for k, v in blobs.items()}
    return safetensors.numpy.save(arrays, metadata=metadata)


def unpack(data: bytes | memoryview, *, file: str | None, limits: Limits
           ) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Parse a safetensors byte string; every tensor is a zero-copy view into `data`."""
    view = memoryview(data)
    if len(view) < 8:
        raise FormatError("truncated: shorter than a safetensors header", file=file)
    (n,) = struct.unpack("<Q", view[:8])
    if n > limits.max_header_bytes:
        raise LimitError(f"safetensors header of {n} B exceeds {limits.max_header_bytes} B", file=file)
    if n > len(view) - 8:
        raise FormatError(f"truncated: header of {n} B in a {len(view)} B file", file=file)
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"safetensors header is not JSON: {e}", file=file) from None
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not an object", file=file)
    body = view[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("safetensors metadata is not a string map", file=file)
    tensors = {}
    for name, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise FormatError(f"bad safetensors entry for {name!r}", file=file)
        d = by_st_code(code, file=file)
        if not begin <= end <= len(body):
            raise FormatError(f"tensor {name!r} lies outside the file (truncated?)", file=file)
        if end - begin != int(np.prod(shape, dtype=object)) * d.itemsize:
            raise FormatError(f"tensor {name!r}: byte span does not match its shape", file=file)
        tensors[name] = RawTensor(d, shape, body[begin:end])
    return tensors, metadata


def compress(data: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def decompress(data: bytes | memoryview, cap: int, *, exact: int | None = None,
               file: str | None = None, what: str = "payload") -> bytearray:
    """Decompress one zstd frame, never producing more than `cap` bytes (zstd-bomb safe)."""
    try:
        declared = zstandard.get_frame_parameters(bytes(data[:18])).content_size
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: not a zstd frame: {e}", file=file) from None
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > cap:
        raise LimitError(f"{what}: zstd frame declares {declared} B, limit {cap} B", file=file)
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
            while chunk := reader.read(min(1 << 22, cap + 1 - len(out))):
                out += chunk
                if len(out) > cap:
                    raise LimitError(f"{what}: decompresses past the {cap} B limit", file=file)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: corrupt zstd data: {e}", file=file) from None
    if exact is not None and len(out) != exact:
        raise FormatError(f"{what}: decompressed to {len(out)} B, expected {exact} B", file=file)
    return out
