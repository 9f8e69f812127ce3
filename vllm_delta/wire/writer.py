"""Writing a delta: changes queued into flushes of about `flush_bytes`, each encoded (the byte layout:
flush_meta.py, docs/wire-format.md) and emitted as it fills; the manifest last."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .blocks import Policy, cuts, dense_cuts
from .container import compress, pack
from .deltas import ParamChange
from .digest import bytes_digest
from .dtypes import by_torch, to_bits
from .encodings import DEFAULT_ENCODING, Encoding, get_encoding
from .flush_meta import FORMAT, FORMAT_BLOCKS
from .manifest import MANIFEST_NAME, FileEntry, Manifest, ParamEntry, write_atomic, write_manifest


class UnchangedValueError(ValueError):
    """`ulp_zstd` codes a step of 0 like +1 ULP: an unchanged position would move on the receiver."""

    def __init__(self, param: str, positions: list[int], encoding: str) -> None:
        self.param, self.positions, self.encoding = param, positions, encoding
        more = " ..." if len(positions) > 8 else ""
        super().__init__(
            f"{param}: {encoding!r} cannot carry unchanged positions "
            f"(new bits equal old bits at positions {positions[:8]}{more})"
        )


def flush_name(rank: int, index: int) -> str:
    return f"rank{rank:04d}_flush{index:06d}.safetensors"


def file_entry(name: str, flush: EncodedFlush) -> FileEntry:
    """The manifest's record of one encoded flush (also for flushes sent over a collective)."""
    return FileEntry(
        name=name,
        bytes=len(flush.data),
        hash=bytes_digest(flush.data),
        decoded_bytes=flush.decoded_bytes,
        changed=flush.changed,
    )


@dataclass(frozen=True)
class EncodedFlush:
    data: bytes
    decoded_bytes: int  # what reading it may decompress: the manifest's `FileEntry.decoded_bytes`
    changed: int


def encode_flush(
    changes: Sequence[ParamChange],
    *,
    encoding: Encoding,
    version: int,
    base_version: int | None,
    blocked: bool = True,
    policy: Policy = Policy(),
) -> EncodedFlush:
    """A bucket of changes as one flush: `vllm-delta/2` (each block's streams their own zstd frames), or
    with `blocked=False` `vllm-delta/1` (a span a param and stream; the streams or the file compressed)."""
    per_block = blocked and encoding.compression != "none"
    per_stream = not blocked and encoding.compression == "streams"
    streams: dict[str, list[bytes]] = {}
    sizes: dict[str, int] = {}  # decoded bytes of each stream
    params: list[dict[str, Any]] = []
    for ch in changes:
        d = by_torch(ch.new_values.dtype)
        numel = int(np.prod(ch.shape, dtype=np.int64))
        t = ch.positions
        pos = None if t is None else t.detach().cpu().numpy().astype(np.int64, copy=False)
        if pos is None and not blocked:  # `vllm-delta/1` has no implicit positions
            assert ch.ranges is not None  # no positions: the change is its ranges (`ParamChange`)
            pos = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in ch.ranges])
        new = to_bits(ch.new_values.detach().cpu().contiguous())
        old = None if ch.old_values is None else to_bits(ch.old_values.detach().cpu().contiguous())
        if pos is None:  # implicit positions: dense blocks (`vllm-delta/2` only)
            assert ch.ranges is not None
            width, blocks = 0, [(f, f + n - 1, a, a + n) for f, a, n in dense_cuts(ch.ranges, policy)]
        else:  # blocks cut by the policy (`vllm-delta/1`: one block)
            width, starts = encoding.positions.width(pos, numel), cuts(pos, policy) if blocked else [0]
            blocks = [(int(pos[a]), int(pos[b - 1]), a, b) for a, b in zip(starts, [*starts[1:], len(pos)])]
        names: list[str] | None = None
        rows, spans = [], {}
        for first, last, a, b in blocks:
            if pos is None:  # value streams only (add_dense refuses a base-relative encoding)
                parts = encoding.values.encode(new[a:b], None, d)
            else:  # `width` param-wide and gaps from the previous block's last, so blocks concatenate
                prev, part_old = int(pos[a - 1]) if a else -1, None if old is None else old[a:b]
                _, parts = encoding.positions.encode(pos[a:b], numel, prev=prev, width=width)
                parts.update(encoding.values.encode(new[a:b], part_old, d))
            names = names or list(parts)
            lengths = []
            for s in names:
                raw, at = parts[s], sizes.get(s, 0)
                blob = compress(raw, encoding.zstd_level) if per_block and raw else raw
                streams.setdefault(s, []).append(blob)
                sizes[s], spans[s] = at + len(raw), [at, at + len(raw)]
                lengths += [len(blob), len(raw)]
            rows.append([first, last, b - a, lengths])
        head = {"name": ch.name, "dtype": d.name, "shape": list(ch.shape), "count": len(new), "width": width}
        params.append({**head, "streams": names, "blocks": rows} if blocked else {**head, "spans": spans})
    blobs = {f"__{s}__": b"".join(parts) for s, parts in streams.items()}
    if per_stream:
        blobs = {k: compress(b, encoding.zstd_level) for k, b in blobs.items()}
    codec = "zstd" if per_block or per_stream else "raw"
    meta = {
        "format": FORMAT_BLOCKS if blocked else FORMAT,
        "encoding": encoding.name,
        "current_version": str(version),
        "base_version": "" if base_version is None else str(base_version),
        "streams": json.dumps({s: {"codec": codec, "size": n} for s, n in sizes.items()}),
        "params": json.dumps(params, separators=(",", ":")),
    }
    data = pack(blobs, meta)
    decoded = sum(sizes.values()) if codec == "zstd" else 0
    if not blocked and encoding.compression == "file":
        data, decoded = compress(data, encoding.zstd_level), len(data)
    return EncodedFlush(data, decoded, sum(p["count"] for p in params))


class FlushBuilder:
    """Queue changes with `add`; each bucket of about `flush_bytes` raw bytes is encoded and handed to
    `emit(name, flush)` (a directory, a background writer, a broadcast buffer); `manifest()` lists them."""

    def __init__(
        self,
        emit: Callable[[str, EncodedFlush], None],
        *,
        version: int,
        base_version: int | None = None,
        encoding: str = DEFAULT_ENCODING,
        flush_bytes: int = 256 << 20,
        rank: int = 0,
        model_elements: int | None = None,
        blocked: bool = True,
        block_policy: Policy = Policy(),
    ):
        self.encoding = get_encoding(encoding)
        if self.encoding.needs_base and base_version is None:
            raise ValueError(f"encoding {encoding!r} is base-relative: give base_version")
        if flush_bytes <= 0:
            raise ValueError("flush_bytes must be positive")
        self.emit = emit
        self.version, self.base_version, self.rank = version, base_version, rank
        self.flush_bytes, self.model_elements = flush_bytes, model_elements
        self.blocked = blocked  # block-indexed `vllm-delta/2` flushes; False writes `vllm-delta/1`
        self.block_policy = block_policy
        self._pending: list[ParamChange] = []
        self._pending_bytes = 0
        self.files: list[FileEntry] = []
        self._params: dict[str, dict] = {}
        self.wire_bytes = 0  # encoded bytes emitted (after compression)
        self.pre_compress_bytes = 0  # the same flushes before compression

    def add(
        self,
        name: str,
        positions: torch.Tensor,
        new_values: torch.Tensor,
        old_values: torch.Tensor | None = None,
        *,
        shape: tuple[int, ...] | torch.Size,
        post_hash: str | None = None,
        _from_scan: bool = False,
    ) -> None:
        """Queue one param's changes: sorted unique int64 flat `positions` and the values there
        (`old_values` for base-relative encodings). `_from_scan`: `Producer.scan`'s own entries, sorted and
        unique out of a bitwise diff, skip those two checks."""
        if name in self._params:
            raise ValueError(f"param {name!r} added twice")
        n = positions.numel()
        if positions.dtype != torch.int64 or positions.dim() != 1 or new_values.shape != (n,):
            raise ValueError(f"{name}: positions must be 1-D int64 and new_values 1-D of the same length")
        if old_values is not None and (old_values.shape != (n,) or old_values.dtype != new_values.dtype):
            raise ValueError(f"{name}: old_values must match new_values in length and dtype")
        if self.encoding.needs_base and old_values is None:
            raise ValueError(f"{name}: encoding {self.encoding.name!r} needs old_values")
        if n == 0:
            return
        d = by_torch(new_values.dtype)
        if self.encoding.needs_base and old_values is not None and not _from_scan:  # bitwise
            same = new_values.detach().view(d.int_view) == old_values.detach().view(d.int_view)
            if bool(same.any()):
                at = positions[same.to(positions.device)].tolist()
                raise UnchangedValueError(name, at, self.encoding.name)
        numel = int(torch.Size(shape).numel())
        if (
            int(positions[0]) < 0
            or int(positions[-1]) >= numel
            or not (_from_scan or bool((positions[1:] > positions[:-1]).all()))
        ):
            raise ValueError(f"{name}: positions must be strictly increasing and inside {list(shape)}")
        self._param(name, d.name, shape, post_hash)["changed"] = n
        per_elem = 8 + 2 * d.itemsize
        chunk = max(1, self.flush_bytes // per_elem)
        for a in range(0, n, chunk):
            old = None if old_values is None else old_values[a : a + chunk]
            ch = ParamChange(name, tuple(shape), positions[a : a + chunk], new_values[a : a + chunk], old)
            self._pending.append(ch)
            self._pending_bytes += ch.new_values.numel() * per_elem
            if self._pending_bytes >= self.flush_bytes:
                self.flush()

    def add_dense(
        self,
        name: str,
        pieces: Iterable[tuple[int, torch.Tensor]],
        *,
        shape: tuple[int, ...] | torch.Size,
        post_hash: str | None = None,
    ) -> None:
        """Queue every element of the dense ranges `pieces`, `(first flat position, 1-D new values)` in
        increasing, disjoint order (an anchor's shard), emitted as flushes fill: about a flush held."""
        if name in self._params:
            raise ValueError(f"param {name!r} added twice")
        if self.encoding.needs_base:
            raise ValueError(
                f"{name}: dense ranges carry new values, {self.encoding.name!r} is base-relative"
            )
        numel = int(torch.Size(shape).numel())
        runs: list[list[int]] = []  # this flush's [start, length] runs of the param, and their values
        parts: list[torch.Tensor] = []

        def queue() -> None:
            if parts:
                values = parts[0] if len(parts) == 1 else torch.cat(parts)
                self._pending.append(
                    ParamChange(name, tuple(shape), None, values, ranges=tuple((a, n) for a, n in runs))
                )
                runs.clear()
                parts.clear()

        end, d = 0, None
        for start, values in pieces:
            n = values.numel()
            if values.dim() != 1 or (d is not None and values.dtype != d.torch):
                raise ValueError(f"{name}: pieces must be 1-D and of one dtype")
            if start < end or start + n > numel:
                raise ValueError(
                    f"{name}: piece [{start}, {start + n}) overlaps the previous one or leaves {list(shape)}"
                )
            if n == 0:
                continue
            if d is None:
                d = by_torch(values.dtype)
                self._param(name, d.name, shape, post_hash)
            self._params[name]["changed"] += n
            a = 0
            while a < n:
                b = min(n, a + max(1, (self.flush_bytes - self._pending_bytes) // d.itemsize))
                if runs and sum(runs[-1]) == start + a:
                    runs[-1][1] += b - a
                else:
                    runs.append([start + a, b - a])
                parts.append(values[a:b])
                self._pending_bytes += (b - a) * d.itemsize
                a = b
                if self._pending_bytes >= self.flush_bytes:
                    queue()
                    self.flush()
            end = start + n
        queue()

    def _param(self, name: str, dtype: str, shape, post_hash: str | None) -> dict:
        """The manifest entry of a param being added."""
        entry = {"name": name, "dtype": dtype, "shape": list(shape), "changed": 0, "files": []}
        self._params[name] = {**entry, "post_hash": post_hash}
        return self._params[name]

    def flush(self) -> None:
        """Encode and emit what is queued (a no-op when nothing is)."""
        if not self._pending:
            return
        name = flush_name(self.rank, len(self.files))
        enc = encode_flush(
            self._pending,
            encoding=self.encoding,
            version=self.version,
            base_version=self.base_version,
            blocked=self.blocked,
            policy=self.block_policy,
        )
        entry = file_entry(name, enc)
        self.emit(name, enc)
        self.files.append(entry)
        self.wire_bytes += entry.bytes
        self.pre_compress_bytes += enc.decoded_bytes if self.encoding.compression != "none" else entry.bytes
        for ch in self._pending:
            files = self._params[ch.name]["files"]
            if name not in files:
                files.append(name)
        self._pending, self._pending_bytes = [], 0

    def manifest(self) -> Manifest:
        """Emit what is pending, then describe every flush and param."""
        self.flush()
        return Manifest(
            version=self.version,
            base_version=self.base_version,
            encoding=self.encoding.name,
            model_elements=self.model_elements,
            files=self.files,
            params=[ParamEntry(**p) for p in self._params.values()],
        )


class DeltaWriter(FlushBuilder):
    """Writes flush files (each atomically) into a version directory; `close` seals it with the manifest.
    Several writers (ranks) may share a directory: each gives its `manifest()`, then `merge_manifests`."""

    def __init__(self, out_dir: str | os.PathLike, **kwargs) -> None:
        super().__init__(lambda name, flush: write_atomic(self.dir / name, flush.data), **kwargs)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / MANIFEST_NAME).exists():
            raise FileExistsError(f"{self.dir} already holds a finished delta")
        self._closed = False

    def add(self, *args, **kwargs) -> None:
        if self._closed:
            raise RuntimeError("writer is closed")
        super().add(*args, **kwargs)

    def close(self) -> Manifest:
        """Write what is pending, then the manifest (last, atomically). Returns the manifest."""
        manifest = self.manifest()
        self._closed = True
        write_manifest(self.dir, manifest)
        return manifest

    def __enter__(self) -> DeltaWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:  # on error leave no manifest: readers see an unfinished delta
            self.close()
