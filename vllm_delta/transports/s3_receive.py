"""The S3 transport's engine half: a version's manifest and flushes, fetched from the object store the
engine was started with (`configured_store`); the sender's half is transports/s3.py.

Why a prefetch of exactly one: fetching flush k+1 while flush k decodes hides the slower of the
two behind the other, and holding no more than those two keeps memory bounded by two flushes,
however large the delta. The bytes go to `DeltaApplier.prepare_flushes` unchanged, so the
decoder checks each one's name, size and file hash from the manifest exactly as for disk.

Sparse fetch: given what this rank owns, a `vllm-delta/2` flush is read as its header plus the
byte ranges of the blocks the rank decodes (wire/blocks.py), as a `SparseFile`. Its hash cannot
be checked, so this is done only where the manifest gives every param of the flush a post
digest: the route then checks the ranks' partial digests of every decoded position and value
before anything is written. Otherwise, or where the owned ranges are most of the file, the
flush is fetched whole and its hash checked.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from vllm_delta import settings
from vllm_delta.transports.store import ObjectStore, StoreError, StoreNotFound, StoreURL, is_store_url
from vllm_delta.wire import MANIFEST_NAME, FileEntry, Manifest, blocks, parse_manifest
from vllm_delta.wire.container import ZSTD_MAGIC, Limits, SparseFile
from vllm_delta.wire.errors import DeltaError, IncompleteDeltaError, IntegrityError, LimitError
from vllm_delta.wire.flush import Owned, plan_blocked
from vllm_delta.wire.flush_meta import FORMAT_BLOCKS, parse_streams

MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~200 B per changed tensor: room for 300k tensors
HEAD_BYTES = 64 << 10  # the first GET of a sparse fetch: the size field and, mostly, the whole header
MERGE_GAP = 64 << 10  # owned ranges closer than this are fetched as one: fewer GETs for a few bytes more
SPARSE_MAX_SHARE = 0.7  # above this share of a file's bytes, fetch it whole (and check its hash)


def configured_store() -> ObjectStore:
    """The store of this engine's own `--delta-updates-root` (exported to the workers in the environment).

    Why from the environment and not the request: where the engine reads from is the operator's
    choice at startup; a request can only name a path under it.
    """
    value = settings.updates_root()
    if not is_store_url(value):
        raise StoreError(
            f"this engine's delta root is not an s3:// URL ({settings.UPDATES_ROOT} is {value!r})"
        )
    return ObjectStore(StoreURL.parse(value))


def fetch_manifest(store: ObjectStore, prefix: str) -> tuple[Manifest, int]:
    """The parsed manifest under `prefix` and its size in bytes; a version without one is unfinished."""
    try:
        data = store.get(f"{prefix}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
    except StoreNotFound:
        raise IncompleteDeltaError(
            f"no manifest in the store under {prefix!r}: the delta is unfinished", file=MANIFEST_NAME
        ) from None
    return parse_manifest(data), len(data)


class StoreFlushes(Iterator[tuple[str, "bytes | SparseFile"]]):
    """(name, bytes) of each flush the manifest lists, in its order, one fetched ahead on a thread.

    `fetched_bytes` counts what came from the store. Close it (or use it as a context manager) so
    a consumer that stops early also stops the fetch thread.
    """

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        files: Sequence[FileEntry],
        *,
        manifest: Manifest | None = None,
        owned: Owned | None = None,
    ) -> None:
        """With `manifest` and `owned` (this rank's position ranges per param), flushes whose
        params all have post digests may be fetched sparse (see the module docstring)."""
        self.fetched_bytes = 0
        self._owned = owned
        self._params: dict[str, list[tuple[str, int]]] = {}  # flush -> (param, numel) of its params
        self._digested: set[str] = set()  # flushes whose params all have post digests
        for f in manifest.files if manifest is not None else ():
            params = [p for p in manifest.params if f.name in p.files]
            self._params[f.name] = [(p.name, math.prod(p.shape)) for p in params]
            if owned is not None and all(p.post_digest for p in params):
                self._digested.add(f.name)
        self._gen = self._run(store, prefix, list(files))

    def __next__(self) -> tuple[str, bytes | SparseFile]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> StoreFlushes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self, store: ObjectStore, prefix: str, files: list[FileEntry]
    ) -> Iterator[tuple[str, bytes | SparseFile]]:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-fetch") as pool:
            ahead: Future[bytes | SparseFile] | None = (
                pool.submit(self._fetch, store, prefix, files[0]) if files else None
            )
            try:
                for i, entry in enumerate(files):
                    data = ahead.result()
                    ahead = (
                        pool.submit(self._fetch, store, prefix, files[i + 1]) if i + 1 < len(files) else None
                    )
                    yield entry.name, data
                    del data  # before the next flush arrives: two in memory at most
            finally:
                if ahead is not None:
                    ahead.cancel()  # not started yet: never runs; running: the pool waits for it

    def _fetch(self, store: ObjectStore, prefix: str, entry: FileEntry) -> bytes | SparseFile:
        key = f"{prefix}/{entry.name}"
        try:
            if entry.name in self._digested and self._owned is not None and self._skips_any(entry):
                return self._fetch_sparse(store, key, entry)
            data = store.get(key, max_bytes=entry.bytes)
        except StoreNotFound as exc:
            raise StoreNotFound(f"{exc.reason}: {key}", file=entry.name) from None
        except LimitError as exc:  # larger than the manifest says: not the object the sender sealed
            raise IntegrityError(
                f"{key} does not match the manifest's {entry.bytes} bytes ({exc.reason})", file=entry.name
            ) from None
        self.fetched_bytes += len(data)
        return data

    def _skips_any(self, entry: FileEntry) -> bool:
        """Whether this rank owns less than all of some param of the flush (else it reads it whole)."""
        return any(
            (r := self._owned.get(name)) is not None and blocks.merge(r) != [(0, numel - 1)]
            for name, numel in self._params[entry.name]
        )

    def _fetch_sparse(self, store: ObjectStore, key: str, entry: FileEntry) -> bytes | SparseFile:
        """The header, then the owned blocks' ranges; whole bytes where sparse would not pay. Every GET
        is pinned to the ETag of the first, so a file replaced mid-fetch is refused, never mixed."""
        size, etag = store.head(key)
        if size != entry.bytes:
            raise IntegrityError(f"{key} is {size} bytes, the manifest says {entry.bytes}", file=entry.name)
        head = store.get_range(key, 0, min(size, HEAD_BYTES), etag=etag)
        ranges = None
        if len(head) >= 8 and head[:4] != ZSTD_MAGIC:
            (n,) = struct.unpack("<Q", head[:8])
            if n <= Limits().max_header_bytes and 8 + n <= size:
                if len(head) < 8 + n:
                    head += store.get_range(key, len(head), 8 + n, etag=etag)
                ranges = block_ranges(head[: 8 + n], self._owned)
        if ranges is not None and any(a < 0 or b > size for a, b in ranges):
            ranges = None  # lengths no writer wrote (past the file, or an int64 sum that wrapped)
        h = len(head)
        if ranges is not None and h + sum(b - a for a, b in ranges if b > h) > SPARSE_MAX_SHARE * size:
            ranges = None
        wanted = [(h, size)] if ranges is None else [(max(a, h), b) for a, b in ranges if b > h]
        out = bytearray(size) if ranges is None else SparseFile(size)
        out[:h] = head
        self.fetched_bytes += h + store.read_into(key, out, wanted, etag=etag)
        if ranges is None:
            return bytes(out)  # whole: the decoder checks its hash
        return out


def block_ranges(header: bytes, owned: Owned) -> list[tuple[int, int]] | None:
    """[start, end) file byte ranges of the blocks `owned` selects in a `vllm-delta/2` flush whose
    first bytes (size field and JSON header) are `header`, merged across gaps under MERGE_GAP;
    None when it is not such a flush or its header does not parse (the whole file is fetched, and
    the decoder says what is wrong). The block index is the reader's own (`flush.plan_blocked`)."""
    try:
        table = json.loads(header[8:])
        meta = table["__metadata__"]
        if meta.get("format") != FORMAT_BLOCKS:
            return None
        smeta = parse_streams(meta, file="")
        at = {s: [int(x) for x in table[f"__{s}__"]["data_offsets"]] for s in smeta}
        sizes = {s: range(b - a) for s, (a, b) in at.items()}  # `plan_blocked` reads lengths only
        out = []
        for p, _, _, _, index, starts in plan_blocked(smeta, sizes, meta, file="", expected=None):
            ranges = owned.get(p.name)
            mask = blocks.wanted(index, None if ranges is None else blocks.merge(ranges))
            for j, s in enumerate(p.streams):
                offsets = (
                    len(header) + at[s][0] + starts[s] + np.concatenate(([0], np.cumsum(index.stored[:, j])))
                )
                out += [(int(offsets[k]), int(offsets[m])) for k, m in blocks.runs(mask)]
    except (DeltaError, KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError):
        return None  # not the writer's layout: fetched whole, and the decoder says what is wrong
    merged: list[tuple[int, int]] = []
    for a, b in sorted(r for r in out if r[1] > r[0]):
        if merged and a - merged[-1][1] < MERGE_GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
