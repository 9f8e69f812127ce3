"""Bucketing param changes into flushes and describing them in a manifest, for any transport.

Why not `wire.DeltaWriter`: it writes each flush synchronously. Here the encoded bytes go to a
callback (a background file writer, or a buffer for a broadcast), so encoding the next flush
overlaps moving the previous one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_delta.wire import (EncodedFlush, FileEntry, Manifest, ParamChange, ParamEntry, encode_flush, file_entry,
                             flush_name, get_encoding)
from vllm_delta.wire.dtypes import by_torch


@dataclass
class SentDelta:
    """What one delta (a version, for one group of engines) put on the wire."""

    kind: str  # "delta" | "catchup" | "anchor"
    manifest: Manifest
    flushes: int
    wire_bytes: int  # encoded bytes (after compression)
    pre_compress_bytes: int  # the same flushes before compression
    encode_s: float = 0.0
    location: str | None = None  # version directory (disk)
    buffers: list[tuple[str, bytes]] = field(default_factory=list)  # (file, bytes) for a collective


class FlushBuilder:
    """Queue changes with `add`; each full bucket is encoded and handed to `emit(name, flush)`."""

    def __init__(self, emit: Callable[[str, EncodedFlush], None], *, version: int, base_version: int | None,
                 encoding: str, flush_bytes: int, rank: int = 0, model_elements: int | None = None) -> None:
        self.encoding = get_encoding(encoding)
        if self.encoding.needs_base and base_version is None:
            raise ValueError(f"encoding {encoding!r} is base-relative: give base_version")
        if flush_bytes <= 0:
            raise ValueError("flush_bytes must be positive")
        self.emit, self.version, self.base_version = emit, version, base_version
        self.flush_bytes, self.rank, self.model_elements = flush_bytes, rank, model_elements
        self._pending: list[ParamChange] = []
        self._pending_bytes = 0
        self.files: list[FileEntry] = []
        self._params: dict[str, dict] = {}
        self.wire_bytes = 0
        self.pre_compress_bytes = 0

    def add(self, name: str, positions: torch.Tensor, new_values: torch.Tensor, old_values: torch.Tensor | None,
            *, shape: tuple[int, ...], post_hash: str | None = None) -> None:
        n = positions.numel()
        if n == 0:
            return
        if name in self._params:
            raise ValueError(f"param {name!r} added twice")
        if self.encoding.needs_base and old_values is None:
            raise ValueError(f"{name}: encoding {self.encoding.name!r} needs old_values")
        d = by_torch(new_values.dtype)
        self._params[name] = {"name": name, "dtype": d.name, "shape": list(shape), "changed": n, "files": [],
                              "post_hash": post_hash}
        per_elem = 8 + 2 * d.itemsize
        chunk = max(1, self.flush_bytes // per_elem)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            self._pending.append(ParamChange(name, tuple(shape), positions[a:b], new_values[a:b],
                                             None if old_values is None else old_values[a:b]))
            self._pending_bytes += (b - a) * per_elem
            if self._pending_bytes >= self.flush_bytes:
                self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        name = flush_name(self.rank, len(self.files))
        enc = encode_flush(self._pending, encoding=self.encoding, version=self.version,
                           base_version=self.base_version)
        entry = file_entry(name, enc)
        self.files.append(entry)
        self.wire_bytes += entry.bytes
        # Before compression: the decoded streams (per-stream zstd), the container (whole-file
        # zstd), or the bytes themselves (no compression).
        self.pre_compress_bytes += enc.decoded_bytes if self.encoding.compression != "none" else entry.bytes
        for ch in self._pending:
            files = self._params[ch.name]["files"]
            if name not in files:
                files.append(name)
        self._pending, self._pending_bytes = [], 0
        self.emit(name, enc)

    def manifest(self) -> Manifest:
        self.flush()
        return Manifest(version=self.version, base_version=self.base_version, encoding=self.encoding.name,
                        model_elements=self.model_elements, files=self.files,
                        params=[ParamEntry(**p) for p in self._params.values()])
