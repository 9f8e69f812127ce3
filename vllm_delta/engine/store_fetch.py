"""A version's manifest and flushes, fetched from the object store the engine was started with.

Why a prefetch of exactly one: fetching flush k+1 while flush k decodes hides the slower of the
two behind the other, and holding no more than those two keeps memory bounded by two flushes,
however large the delta. The bytes go to `DeltaApplier.prepare_flushes` unchanged, so the
decoder checks each one's name, size and file hash from the manifest exactly as for disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from vllm_delta.native import ROOT_ENV
from vllm_delta.transports.store import ObjectStore, StoreError, StoreNotFound, StoreURL, is_store_url
from vllm_delta.wire import MANIFEST_NAME, FileEntry, Manifest, parse_manifest
from vllm_delta.wire.errors import IncompleteDeltaError, IntegrityError, LimitError

MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~200 B per changed tensor: room for 300k tensors


def configured_store() -> ObjectStore:
    """The store of this engine's own `--delta-updates-root` (exported to the workers in `ROOT_ENV`).

    Why from the environment and not the request: where the engine reads from is the operator's
    choice at startup; a request can only name a path under it.
    """
    value = os.environ.get(ROOT_ENV, "")
    if not is_store_url(value):
        raise StoreError(f"this engine's delta root is not an s3:// URL ({ROOT_ENV} is {value!r})")
    return ObjectStore(StoreURL.parse(value))


def fetch_manifest(store: ObjectStore, prefix: str) -> tuple[Manifest, int]:
    """The parsed manifest under `prefix` and its size in bytes; a version without one is unfinished."""
    try:
        data = store.get(f"{prefix}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
    except StoreNotFound:
        raise IncompleteDeltaError(f"no manifest in the store under {prefix!r}: the delta is unfinished",
                                   file=MANIFEST_NAME) from None
    return parse_manifest(data), len(data)


class StoreFlushes:
    """(name, bytes) of each flush the manifest lists, in its order, one fetched ahead on a thread.

    `fetched_bytes` counts what came from the store. Close it (or use it as a context manager) so
    a consumer that stops early also stops the fetch thread.
    """

    def __init__(self, store: ObjectStore, prefix: str, files: Sequence[FileEntry]) -> None:
        self.fetched_bytes = 0
        self._gen = self._run(store, prefix, list(files))

    def __iter__(self) -> StoreFlushes:
        return self

    def __next__(self) -> tuple[str, bytes]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> StoreFlushes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, store: ObjectStore, prefix: str, files: list[FileEntry]) -> Iterator[tuple[str, bytes]]:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-fetch") as pool:
            ahead: Future[bytes] | None = pool.submit(self._fetch, store, prefix, files[0]) if files else None
            try:
                for i, entry in enumerate(files):
                    data = ahead.result()
                    ahead = pool.submit(self._fetch, store, prefix, files[i + 1]) if i + 1 < len(files) else None
                    yield entry.name, data
                    del data  # before the next flush arrives: two in memory at most
            finally:
                if ahead is not None:
                    ahead.cancel()  # not started yet: never runs; running: the pool waits for it

    def _fetch(self, store: ObjectStore, prefix: str, entry: FileEntry) -> bytes:
        key = f"{prefix}/{entry.name}"
        try:
            data = store.get(key, max_bytes=entry.bytes)
        except StoreNotFound as exc:
            raise StoreNotFound(f"{exc.reason}: {key}", file=entry.name) from None
        except LimitError as exc:  # larger than the manifest says: not the object the sender sealed
            raise IntegrityError(f"{key} does not match the manifest's {entry.bytes} bytes ({exc.reason})",
                                 file=entry.name) from None
        self.fetched_bytes += len(data)
        return data
