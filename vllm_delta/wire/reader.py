"""Reading a delta: open and check its manifest, then decode it one flush at a time (`DeltaDecoder`
holds the checks that span files; every transport feeds it flush bytes)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fnmatch import fnmatch
from itertools import compress, count, repeat
from operator import attrgetter, contains, gt
from pathlib import Path
from typing import Any, cast

import torch

from .batch_device import HOST, Decoder
from .container import DeltaDir, Limits, SparseFile, paused_gc
from .deltas import DeltaBatch, ParamDelta
from .dtypes import by_name
from .encodings import Encoding, get_encoding
from .errors import BoundsError, DeltaError, FormatError, IncompleteDeltaError, IntegrityError
from .flush import Owned, iter_flush, open_flush
from .flush_meta import FLUSH_FORMATS, Expected, FlushHeader, HeadCheck
from .lineage import check_base
from .manifest import MANIFEST_NAME, FileEntry, Manifest, parse_manifest
from .seed_format import decode_seed_flush, seed_manifest

FLUSH_GLOB = "rank*_flush*.safetensors"


@dataclass(frozen=True)
class DeltaInfo:
    """An opened delta: its open directory, its manifest (a seed delta's made from its flush files)."""

    path: Path
    manifest: Manifest
    seed: bool
    dir: DeltaDir

    @property
    def encoding(self) -> Encoding:
        return get_encoding(self.manifest.encoding)


class DeltaDecoder:
    """Validates and decodes the flushes of one delta, in any transport: feed every file the manifest
    lists (in its order), then `finish()`; apply nothing before it returns. `decoder`: the batched
    decode's back end (`batch_device.HOST`, or a `Decoder` of devices, whose `verify` the caller calls)."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        expected: Expected | None = None,
        current_version: int | None = None,
        seed: bool = False,
        limits: Limits = Limits(),
        decoder: Decoder = HOST,
    ):
        self.manifest, self.expected, self.seed, self.limits = manifest, expected, seed, limits
        self.decoder = decoder
        check_base(manifest, current_version)
        self._files = {f.name: f for f in manifest.files}
        # What admit compares and counts, as columns by manifest position (`_index`): each param's head
        # (shape, dtype), files, parts (several writers: each file's part in `_part`) and change count.
        # The model's heads compared in one comparison; where that fails, a param at a time (`HeadCheck`).
        params = manifest.params
        self._names = names = list(map(attrgetter("name"), params))
        self._changed = list(map(attrgetter("changed"), params))
        shapes = list(map(tuple, map(attrgetter("shape"), params)))
        dnames = list(map(attrgetter("dtype"), params))
        try:
            known = {n: by_name(n).torch for n in set(dnames)}
            heads = list(zip(shapes, map(known.__getitem__, dnames)))
            fits = expected is None or list(map(expected.get, names)) == heads
        except DeltaError:
            fits = False
        if not fits:
            deque(map(HeadCheck(expected, file=MANIFEST_NAME), names, dnames, shapes), 0)
        parts = list(map(attrgetter("parts"), params))
        self._index = dict(zip(names, count()))
        self._heads, self._listed = heads, list(map(attrgetter("files"), params))
        self._has_parts = list(map(bool, parts))
        shared = list(compress(params, parts))  # the params of several writers, without a loop over all
        self._part = {(p.name, f): i for p in shared for i, part in enumerate(p.parts or ()) for f in part}
        # Positions of parts are kept until finish() checks that no two parts overlap.
        self._shared: dict[str, list[torch.Tensor]] = {p.name: [] for p in shared}
        self._seen: dict[str, int] = {}
        self._last: dict[tuple[str, int], int] = {}
        self._done: set[str] = set()

    def feed(self, name: str, data: bytes | memoryview, *, owned: Owned | None = None) -> list[ParamDelta]:
        """Decode one flush's bytes; all of its checks pass before anything is returned."""
        return cast("list[ParamDelta]", list(self.feed_iter(name, data, owned=owned)))  # no batches asked

    def feed_iter(
        self, name: str, data: bytes | memoryview, *, owned: Owned | None = None, batches: bool = False
    ) -> Iterator[ParamDelta | DeltaBatch]:
        """Decode one flush's bytes a param at a time (`flush.iter_flush`): hash, header and block index
        checked first. A `SparseFile` skips the file hash: the caller's cross-rank check of the post
        digests, which every param of the file must then have, verifies what it decodes."""
        return self.admit(name, self.decode(name, data, owned=owned, batches=batches))

    def decode(
        self, name: str, data: bytes | memoryview, *, owned: Owned | None = None, batches: bool = False
    ) -> Iterator[ParamDelta | DeltaBatch]:
        """`feed_iter`'s checks of this file alone, then its params, lazily, not yet admitted: it reads no
        state other files change, so flushes decode on several threads and are admitted in order."""
        entry = self._files.get(name)
        if entry is None:
            raise FormatError("file is not in the manifest", file=name)
        if len(data) != entry.bytes:
            raise IntegrityError(f"{len(data)} B, manifest says {entry.bytes} B (truncated?)", file=name)
        sparse = isinstance(data, SparseFile)  # only owned blocks fetched: no file hash to check
        if sparse and not all(p.post_digest for p in self.manifest.params if name in p.files):
            raise IntegrityError(
                "a sparse fetch is only verifiable with every param's post_digest", file=name
            )
        tensors, meta, budget = open_flush(
            data,
            file=name,
            limits=self.limits,
            max_decoded=None if self.seed else entry.decoded_bytes,
            expected_hash=None if sparse else entry.hash,
        )
        deltas: Iterable[ParamDelta | DeltaBatch]
        if self.seed:
            header, deltas = decode_seed_flush(tensors, meta, file=name, expected=self.expected)
        elif meta.get("format") not in FLUSH_FORMATS:
            raise FormatError(f"format {meta.get('format')!r} is not one of {FLUSH_FORMATS}", file=name)
        else:
            header, deltas = iter_flush(
                tensors,
                meta,
                budget,
                file=name,
                expected=self.expected,
                owned=owned,
                batches=batches,
                decoder=self.decoder,
            )
        m = self.manifest  # (a seed delta's has no base version, as its flushes have none)
        if header != FlushHeader(m.encoding, m.version, m.base_version):
            raise FormatError("flush header disagrees with the manifest's encoding or versions", file=name)
        return iter(deltas)

    def admit(
        self, name: str, deltas: Iterable[ParamDelta | DeltaBatch]
    ) -> Iterator[ParamDelta | DeltaBatch]:
        """The checks across files (order, overlaps, counts) of one decoded flush, in manifest order; a
        `DeltaBatch` checked whole (`_admitted`), or, where that does not decide, a param at a time."""
        if name in self._done:
            raise FormatError("file fed twice", file=name)
        self._done.add(name)
        index, parts, ends, shared, seen = self._index, self._part, self._last, self._shared, self._seen
        heads, listed, has_parts, counts = self._heads, self._listed, self._has_parts, self._changed
        for item in deltas:
            if type(item) is DeltaBatch:
                if self._admitted(name, item):
                    yield item
                    continue
                self._done.discard(name)  # marked fed again by the per-param checks
                yield from self.admit(name, item.deltas())
                continue
            pd = item
            param = pd.name
            i = index.get(param)
            if i is None or name not in listed[i]:
                raise FormatError("param is not listed for this file in the manifest", file=name, param=param)
            if heads[i] != (pd.shape, pd.dtype):
                raise FormatError("shape or dtype differs from the manifest", file=name, param=param)
            changed = counts[i]
            part = (param, parts[(param, name)] if has_parts[i] else 0)
            end = ends.get(part)
            bounds = pd.bounds
            if end is not None and (bounds[0] if bounds is not None else pd.first) <= end:
                raise BoundsError("chunks overlap or are out of order", file=name, param=param)
            ends[part] = bounds[1] if bounds is not None else pd.last
            if param in shared:  # skipped blocks are checked by the ranks that decode them
                shared[param].append(pd.positions)
            total = seen[param] = seen.get(param, 0) + pd.total
            if total > changed:
                raise BoundsError(
                    f"more than the {changed} changes the manifest lists", file=name, param=param
                )
            yield pd

    def _admitted(self, name: str, batch: DeltaBatch) -> bool:
        """`admit`'s checks of a batch as columns, and its bookkeeping, when each param is listed for this
        file with this head, of one writer, met for the first time and within its count; else False,
        nothing recorded, and the per-param checks decide."""
        names = batch.names
        found = list(map(self._index.get, names))
        if None in found or len(set(found)) != len(found):
            return False
        at = cast("list[int]", found)  # no None: checked above
        if True in map(self._has_parts.__getitem__, at) or not all(
            map(contains, map(self._listed.__getitem__, at), repeat(name))
        ):  # several writers, or not this file's
            return False
        if list(map(self._heads.__getitem__, at)) != list(zip(batch.shapes, batch.dtypes)):
            return False
        changed = map(self._changed.__getitem__, at)
        keys = list(zip(names, repeat(0)))
        if not (self._seen.keys().isdisjoint(names) and self._last.keys().isdisjoint(keys)):
            return False
        if any(map(gt, batch.counts, changed)):
            return False
        self._last.update(zip(keys, batch.last))
        self._seen.update(zip(names, batch.counts))
        return True

    def finish(self) -> None:
        """Every fed param is complete; with all files fed, the whole delta is."""
        if list(map(self._seen.get, self._names, repeat(0))) != self._changed:  # else each is complete
            for p in self.manifest.params:  # in manifest order, those whose files were all fed
                seen = self._seen.get(p.name, 0)
                if seen != p.changed and all(f in self._done for f in p.files):
                    raise BoundsError(f"{seen} changes, manifest says {p.changed}", param=p.name)
        for name, chunks in self._shared.items():
            merged = torch.cat(chunks).sort().values if chunks else None
            if merged is not None and bool((merged[1:] == merged[:-1]).any()):
                raise BoundsError("parts from different writers overlap", param=name)


def open_delta(
    path: str | os.PathLike | DeltaDir,
    *,
    files: Sequence[str] | None = None,
    limits: Limits = Limits(),
    allow_seed: bool = False,
) -> DeltaInfo:
    """Open a version directory: with a manifest, or (`allow_seed`) a seed delta (flush files, no manifest;
    its checksum misses swapped values and renamed params). `files`: a seed delta's files."""
    d = path if isinstance(path, DeltaDir) else DeltaDir.open(path)
    if d.has(MANIFEST_NAME):
        text = d.read(MANIFEST_NAME, cap=limits.max_manifest_bytes)
        with paused_gc():  # a few objects per tensor (container.paused_gc says why)
            m = parse_manifest(text)
        get_encoding(m.encoding)
        for f in m.files:
            if not d.has(f.name):
                raise IncompleteDeltaError("file named by the manifest is missing", file=f.name)
        return DeltaInfo(d.path, m, seed=False, dir=d)
    names = list(files) if files is not None else sorted(n for n in d.names() if fnmatch(n, FLUSH_GLOB))
    if names and not allow_seed:
        raise IncompleteDeltaError(
            "no manifest: the delta is unfinished, or in the seed's manifest-less format, which is "
            "read only where allowed (--delta-updates-allow-seed-format)",
            file=MANIFEST_NAME,
        )
    if not names:
        raise IncompleteDeltaError(
            "no manifest and no flush files: the delta is unfinished", file=MANIFEST_NAME
        )
    return DeltaInfo(d.path, seed_manifest(d, names, limits), seed=True, dir=d)


def iter_delta(
    delta: str | os.PathLike | DeltaInfo,
    *,
    expected: Expected | None = None,
    current_version: int | None = None,
    files: Sequence[str] | None = None,
    limits: Limits = Limits(),
    owned: Owned | None = None,
    lazy: bool = False,
    threads: int = 1,
    batches: bool = False,
    decoder: Decoder = HOST,
    allow_seed: bool = False,
) -> Iterator[ParamDelta | DeltaBatch]:
    """Decoded changes, one flush file at a time (a param may come in chunks, in position order). A file's
    errors are raised before any of its changes (with `lazy`, a param's when it is reached); count checks
    across files run after the last, so apply nothing until it is exhausted. `threads` > 1: that many
    flushes decode ahead on their own threads, admitted in manifest order."""
    info = (
        delta
        if isinstance(delta, DeltaInfo)
        else open_delta(delta, files=files, limits=limits, allow_seed=allow_seed)
    )
    dec = DeltaDecoder(
        info.manifest,
        expected=expected,
        current_version=current_version,
        seed=info.seed,
        limits=limits,
        decoder=decoder,
    )
    wanted = None if files is None or info.seed else set(files)
    entries = [e for e in info.manifest.files if wanted is None or e.name in wanted]
    feed: dict[str, Any] = {"owned": owned, "batches": batches}
    if threads > 1 and len(entries) > 1:
        yield from _decoded_ahead(info, dec, entries, threads, feed)
    else:
        for entry in entries:
            data = info.dir.read(entry.name, size=entry.bytes, cap=entry.bytes)
            got = dec.feed_iter(entry.name, data, **feed)
            yield from got if lazy else list(got)
            del data
    dec.finish()


def _decoded_ahead(
    info: DeltaInfo, dec: DeltaDecoder, entries: list[FileEntry], threads: int, feed: dict
) -> Iterator[ParamDelta | DeltaBatch]:
    """Flushes decoded `threads` at a time on a pool (zstd, numpy and hashing release the GIL); one starts
    only while the decoded bytes the manifest allows those in flight stay within `max_decoded_at_once`."""
    cap = dec.limits.max_decoded_at_once
    # A seed delta's manifest states no decoded sizes: each of its flushes may decompress the per-flush cap.
    allows = {e.name: dec.limits.max_decoded_bytes if dec.seed else e.decoded_bytes for e in entries}

    def decode(entry: FileEntry) -> list[ParamDelta | DeltaBatch]:
        data = info.dir.read(entry.name, size=entry.bytes, cap=entry.bytes)
        return list(dec.decode(entry.name, data, **feed))

    pool = ThreadPoolExecutor(threads, thread_name_prefix="delta-decode")
    ahead: deque[tuple[FileEntry, Future]] = deque()
    todo = deque(entries)
    held = 0  # decoded bytes the manifest allows the flushes started and not yet consumed

    def start() -> None:
        nonlocal held
        while todo and len(ahead) < threads and (held == 0 or held + allows[todo[0].name] <= cap):
            entry = todo.popleft()
            held += allows[entry.name]
            ahead.append((entry, pool.submit(decode, entry)))

    try:
        start()
        while ahead:
            entry, future = ahead.popleft()
            decoded = future.result()  # a file's error, raised in manifest order
            start()
            yield from dec.admit(entry.name, decoded)
            del decoded
            held -= allows[entry.name]
            start()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def read_delta(delta: str | os.PathLike | DeltaInfo, **kwargs) -> list[ParamDelta]:
    """All decoded changes of a delta, fully validated (see `iter_delta` for the arguments)."""
    return cast("list[ParamDelta]", list(iter_delta(delta, **kwargs)))  # `batches` is not for this
