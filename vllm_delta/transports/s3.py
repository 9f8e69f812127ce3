"""S3 transport, for engines that share no filesystem or collective with the trainer: flush objects under
`s3://BUCKET/PREFIX/<version dir>/`, the manifest last, kept until every engine acknowledged them plus
the chain late joiners replay (docs/sender.md); the engine's half fetches one flush ahead, sparse where
that pays (the header and this rank's blocks, checked by the ranks' partial digests)."""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_delta import settings
from vllm_delta.transports.base import SentDelta, StoredTransport, TransportOptions
from vllm_delta.transports.store import ObjectStore, StoreError, StoreNotFound, StoreURL, is_store_url
from vllm_delta.wire import MANIFEST_NAME, FileEntry, Manifest, blocks, parse_manifest
from vllm_delta.wire.container import ZSTD_MAGIC, Limits, SparseFile
from vllm_delta.wire.errors import DeltaError, IncompleteDeltaError, IntegrityError, LimitError
from vllm_delta.wire.flush import Owned, plan_blocked
from vllm_delta.wire.flush_meta import FORMAT_BLOCKS, parse_streams

logger = logging.getLogger(__name__)


@dataclass
class Stored:
    """A sealed version in the store, as the lifecycle and the catch-up need it."""

    name: str  # version dir
    version: int
    kind: str
    base_version: int | None
    min_version: int | None  # lineage range (None: an anchor, valid on any weights)
    max_version: int | None

    def applies_at(self, version: int) -> bool:
        if self.base_version is not None and self.base_version != version:
            return False
        return self.min_version is None or self.min_version <= version <= self.max_version


class S3Transport(StoredTransport):
    """Flush objects under `url/<version dir>`."""

    def __init__(self, name: str, options: TransportOptions) -> None:
        url = str(options.delta_dir or "")
        if not url.startswith("s3://"):
            why = f"the s3 transport needs delta_dir='s3://BUCKET/PREFIX', not {options.delta_dir!r}"
            raise ValueError(why)
        self.url = StoreURL.parse(url)
        self.store = ObjectStore(self.url, throttle_bytes_per_s=options.throttle_bytes_per_s)
        self.planner, self.keep, self.keep_chain = options.planner, options.keep, 16
        self.sealed: dict[str, Stored] = {}
        self.unsealed: set[str] = set()  # prepared, never sealed (a failed sync): deleted at the next cleanup
        self.checkpoint_chain = options.version == 0  # version 0 is the checkpoint every engine starts from

    @property
    def uploaded_bytes(self) -> int:
        return self.store.uploaded_bytes

    def prepare(self, name: str) -> None:
        """No leftover objects (e.g. of a sender that died), manifest first."""
        self.sealed.pop(name, None)
        self.unsealed.add(name)
        self._remove(name)  # raises: a leftover manifest must go

    def writer(self, name: str) -> Callable[[str, bytes], None]:
        return lambda file, data: self.store.put(self.url.key(name, file), data)

    def seal(self, sent: SentDelta) -> None:
        m: Manifest = sent.manifest
        self.store.put(self.url.key(sent.location, MANIFEST_NAME), m.model_dump_json(indent=1).encode())
        self.unsealed.discard(sent.location)
        lo, hi = (m.lineage.min_version, m.lineage.max_version) if m.lineage else (None, None)
        self.sealed[sent.location] = Stored(sent.location, m.version, sent.kind, m.base_version, lo, hi)

    def chain(self) -> tuple[int, list[Stored]] | None:
        """(start version, the versions after it) an engine can replay: the latest anchor, or the
        checkpoint if no anchor was sent yet; None when no chain is kept."""
        ordered = sorted(self.sealed.values(), key=lambda s: s.version)
        anchors = [s for s in ordered if s.kind == "anchor"]
        if anchors:
            start = anchors[-1]
            after = [s for s in ordered if s.kind != "anchor" and s.version > start.version]
            return (start.version, [start] + after) if len(after) <= self.keep_chain else None
        if not self.checkpoint_chain:
            return None
        return (0, ordered) if len(ordered) <= self.keep_chain else None

    def catch_up(self, status: dict[str, Any], target: int) -> list[dict[str, Any]] | None:
        """The pushes that take an engine in `status` to `target` from the kept chain, in order; None
        if the chain does not reach it (the planner then anchors the engine as before)."""
        chain = self.chain()
        if chain is None or target == 0:
            return None
        start, versions = chain
        v = status.get("version")
        if versions and versions[0].kind == "anchor":
            if v is None or v > start:  # an engine accepts no version below its own
                return None
            reach, rest = {start: versions[:1]}, versions[1:]
        elif start == 0 and v == 0 and status.get("run_id") is None:  # the checkpoint starts the chain
            reach, rest = {0: []}, versions
        else:
            return None
        for s in rest:  # each version, by the replay of the latest reachable version it applies to
            for u in sorted(reach, reverse=True):
                if u < s.version and s.version not in reach and s.applies_at(u):
                    reach[s.version] = reach[u] + [s]
                    break
        steps = reach.get(target) or []
        return [{"path": s.name, "version": s.version, "base_version": s.base_version} for s in steps] or None

    def cleanup(self, sent: list[SentDelta]) -> None:
        """Delete every version all engines have moved past, except the kept chain."""
        if self.keep or self.planner is None:
            return
        for name in self.unsealed - {s.location for s in sent}:
            if self._delete(name):
                self.unsealed.discard(name)
        engines = list(self.planner.engines.values())
        chain = self.chain()
        kept = {s.name for s in chain[1]} if chain else set()
        for name, s in list(self.sealed.items()):
            done = all(e.needs_anchor or (e.acked is not None and e.acked >= s.version) for e in engines)
            if done and name not in kept and self._delete(name):
                del self.sealed[name]
        if chain is None:
            self.checkpoint_chain = False  # versions of the checkpoint's chain are gone: it never comes back

    def _remove(self, name: str) -> None:
        """One version dir, manifest first so no reader sees it as finished."""
        self.store.delete_prefix(self.url.key(name, MANIFEST_NAME))
        self.store.delete_prefix(self.url.key(name) + "/")

    def _delete(self, name: str) -> bool:
        """`_remove`, or False if the store failed (the sync stays good: the next cleanup tries again)."""
        try:
            self._remove(name)
        except StoreError as exc:
            logger.warning("delta sender: could not delete %s from the store (%s); retrying later", name, exc)
            return False
        return True


MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~200 B per changed tensor: room for 300k tensors
HEAD_BYTES = 64 << 10  # the first GET of a sparse fetch: the size field and, mostly, the whole header
MERGE_GAP = 64 << 10  # owned ranges closer than this are fetched as one: fewer GETs for a few bytes more
SPARSE_MAX_SHARE = 0.7  # above this share of a file's bytes, fetch it whole (and check its hash)


def configured_store() -> ObjectStore:
    """The store of this engine's own `--delta-updates-root` (where it reads is the operator's choice at
    startup; a request only names a path under it)."""
    value = settings.updates_root()
    if not is_store_url(value):
        why = f"this engine's delta root is not an s3:// URL ({settings.UPDATES_ROOT} is {value!r})"
        raise StoreError(why)
    return ObjectStore(StoreURL.parse(value))


def fetch_manifest(store: ObjectStore, prefix: str) -> tuple[Manifest, int]:
    """The parsed manifest under `prefix` and its size in bytes; a version without one is unfinished."""
    try:
        data = store.get(f"{prefix}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
    except StoreNotFound:
        why = f"no manifest in the store under {prefix!r}: the delta is unfinished"
        raise IncompleteDeltaError(why, file=MANIFEST_NAME) from None
    return parse_manifest(data), len(data)


class StoreFlushes(Iterator[tuple[str, "bytes | SparseFile"]]):
    """(name, bytes) of each flush listed, one fetched ahead on a thread (`with`: stopping early stops it),
    sparse where `owned` and post digests let it pay; `fetched_bytes` counts what came from the store."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        files: Sequence[FileEntry],
        *,
        manifest: Manifest | None = None,
        owned: Owned | None = None,
    ) -> None:
        self.store, self.prefix, self.owned, self.fetched_bytes = store, prefix, owned, 0
        self.sparse: dict[str, list[tuple[str, int]]] = {}  # flush -> (param, numel) of its params
        for f in manifest.files if manifest is not None and owned is not None else ():
            params = [p for p in manifest.params if f.name in p.files]
            if all(p.post_digest for p in params):
                self.sparse[f.name] = [(p.name, math.prod(p.shape)) for p in params]
        self._gen = self._run(list(files))

    def __next__(self) -> tuple[str, bytes | SparseFile]:
        return next(self._gen)

    def __enter__(self) -> StoreFlushes:
        return self

    def __exit__(self, *exc: object) -> None:
        self._gen.close()

    close = __exit__

    def _run(self, files: list[FileEntry]) -> Iterator[tuple[str, bytes | SparseFile]]:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-fetch") as pool:
            ahead = pool.submit(self._fetch, files[0]) if files else None
            try:
                for i, entry in enumerate(files):
                    data = ahead.result()
                    ahead = pool.submit(self._fetch, files[i + 1]) if i + 1 < len(files) else None
                    yield entry.name, data
                    del data  # before the next flush arrives: two in memory at most
            finally:
                if ahead is not None:
                    ahead.cancel()  # not started yet: never runs; running: the pool waits for it

    def _fetch(self, entry: FileEntry) -> bytes | SparseFile:
        key = f"{self.prefix}/{entry.name}"
        try:
            if self._skips_any(entry):
                return self._fetch_sparse(key, entry)
            data = self.store.get(key, max_bytes=entry.bytes)
        except StoreNotFound as exc:
            raise StoreNotFound(f"{exc.reason}: {key}", file=entry.name) from None
        except LimitError as exc:  # larger than the manifest says: not the object the sender sealed
            why = f"{key} does not match the manifest's {entry.bytes} bytes ({exc.reason})"
            raise IntegrityError(why, file=entry.name) from None
        self.fetched_bytes += len(data)
        return data

    def _skips_any(self, entry: FileEntry) -> bool:
        """Whether this rank owns less than all of some param of a sparse-capable flush."""
        return any(
            (r := self.owned.get(name)) is not None and blocks.merge(r) != [(0, numel - 1)]
            for name, numel in self.sparse.get(entry.name, ())
        )

    def _fetch_sparse(self, key: str, entry: FileEntry) -> bytes | SparseFile:
        """The header, then the owned blocks' ranges; whole bytes where sparse would not pay. Every GET
        is pinned to the ETag of the first, so a file replaced mid-fetch is refused, never mixed."""
        store = self.store
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
                ranges = block_ranges(head[: 8 + n], self.owned)
        h = len(head)
        if ranges is not None and (
            any(a < 0 or b > size for a, b in ranges)  # past the file, or an int64 sum that wrapped
            or h + sum(b - a for a, b in ranges if b > h) > SPARSE_MAX_SHARE * size
        ):
            ranges = None
        wanted = [(h, size)] if ranges is None else [(max(a, h), b) for a, b in ranges if b > h]
        out = bytearray(size) if ranges is None else SparseFile(size)
        out[:h] = head
        self.fetched_bytes += h + store.read_into(key, out, wanted, etag=etag)
        return bytes(out) if ranges is None else out  # whole: the decoder checks its hash


def block_ranges(header: bytes, owned: Owned) -> list[tuple[int, int]] | None:
    """[start, end) byte ranges of the blocks `owned` selects in a `vllm-delta/2` flush whose size field and
    JSON header are `header` (the reader's own block index), merged across gaps under MERGE_GAP; None
    for any other file (fetched whole: the decoder says what is wrong)."""
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
                first = len(header) + at[s][0] + starts[s]  # the stream's first byte in the file
                offsets = first + np.concatenate(([0], np.cumsum(index.stored[:, j])))
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
