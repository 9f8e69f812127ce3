"""The manifest, written last and atomically: what makes a version directory a delta. It lists every
flush file (size, hash) and every changed param (dtype, shape, count, files in order, digests)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .additive import DIGEST_ALGO, combine
from .container import DeltaDir, Limits
from .digest import HASH_ALGO
from .errors import FormatError, VersionError

MANIFEST_NAME = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
FORMAT: Final = "vllm-delta/1"

NonNeg = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    name: str
    bytes: NonNeg
    hash: str
    # Total bytes that decompression of this file may produce; the reader's zstd cap.
    decoded_bytes: NonNeg = 0
    changed: NonNeg = 0  # changed elements in this file, for reporting

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not _SAFE_NAME.match(v) or v == MANIFEST_NAME:
            raise ValueError(f"unsafe file name {v!r}")
        return v


class ParamEntry(_Strict):
    name: str
    dtype: str
    shape: list[NonNeg]
    changed: Annotated[int, Field(ge=1)]
    files: list[str] = Field(min_length=1)
    # Several writers (ranks holding shards): a partition of `files`, each part in position order.
    parts: list[list[str]] | None = None
    post_hash: str | None = None  # xxh3 of the whole tensor after apply (one writer only)
    # Additive digests (wire/additive.py): of the whole tensor after, and of the listed positions
    # before (base-relative deltas only) and after apply. Shards add up.
    digest: str | None = None
    pre_digest: str | None = None
    post_digest: str | None = None

    @model_validator(mode="after")
    def _parts_partition_files(self) -> ParamEntry:
        if self.parts is not None and sorted(f for part in self.parts for f in part) != sorted(self.files):
            raise ValueError(f"param {self.name!r}: parts do not partition its files")
        return self


class LineageError(VersionError):
    """An update for another run's weights, or for engine versions other than this engine's (409)."""


class Lineage(_Strict):
    """Which weights an update applies to: versions `min_version`..`max_version` of run `run_id` (a version
    alone does not say whose weights an engine holds). No bounds: a full anchor, valid on any weights."""

    run_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    min_version: NonNeg | None = None
    max_version: NonNeg | None = None

    @model_validator(mode="after")
    def _range(self) -> Lineage:
        lo, hi = self.min_version, self.max_version
        if (lo is None) != (hi is None):
            raise ValueError("lineage: give both min_version and max_version, or neither (an anchor)")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"lineage: min_version {lo} > max_version {hi}")
        return self


class Signature(_Strict):
    """Who vouches for a manifest (wire/signing.py); `key_id` says which of the receiver's keys checks it."""

    alg: str = Field(min_length=1, max_length=32)
    key_id: str = Field(min_length=1, max_length=64)
    sig: str = Field(min_length=1, max_length=1024)


class Manifest(_Strict):
    format: Literal["vllm-delta/1"] = FORMAT
    version: int
    base_version: int | None = None
    encoding: str
    hash_algo: Literal["xxh3_128"] = HASH_ALGO
    digest_algo: Literal["add2x64-splitmix"] = DIGEST_ALGO
    # Elements in the whole model (changed or not), so density can be reported.
    model_elements: NonNeg | None = None
    files: list[FileEntry] = []
    params: list[ParamEntry] = []
    # Which weights it applies to (absent in older manifests and hand-made deltas): check_lineage.
    lineage: Lineage | None = None
    # Set by a sender given signing keys; unsigned manifests keep their bytes (no key).
    signature: Signature | None = Field(default=None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("duplicate file names")
        known = set(names)
        params = list(map(attrgetter("name"), self.params))
        if len(set(params)) == len(params) and known.issuperset(
            chain.from_iterable(map(attrgetter("files"), self.params))
        ):
            return self  # else the first param at fault, in order:
        seen: set[str] = set()
        for p in self.params:
            if p.name in seen:
                raise ValueError(f"param {p.name!r} listed twice")
            seen.add(p.name)
            if missing := [f for f in p.files if f not in known]:
                raise ValueError(f"param {p.name!r} names unlisted files {missing}")
        return self

    @property
    def changed(self) -> int:
        return sum(p.changed for p in self.params)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def merge_manifests(parts: list[Manifest]) -> Manifest:
    """One manifest from several writers' partial ones (one per rank) of the same delta: a param several
    writers hold shards of becomes one entry (counts and additive digests add up, each writer's files a
    part); whole-tensor xxh3 hashes cannot be combined, so such a param must not carry one."""
    if len({(p.version, p.base_version, p.encoding, p.lineage) for p in parts}) > 1:
        raise ValueError("manifests disagree on version, base_version, encoding or lineage")
    by_name: dict[str, list[ParamEntry]] = {}
    for e in (e for p in parts for e in p.params):
        by_name.setdefault(e.name, []).append(e)
    files = [f for p in parts for f in p.files]
    params = [_merge_entries(es) for es in by_name.values()]
    return Manifest(**{**parts[0].__dict__, "files": files, "params": params, "signature": None})


def _merge_entries(entries: list[ParamEntry]) -> ParamEntry:
    if len(entries) == 1:
        return entries[0]
    first = entries[0]
    if any((e.dtype, e.shape) != (first.dtype, first.shape) for e in entries):
        raise ValueError(f"writers disagree on the dtype or shape of {first.name!r}")
    if any(e.post_hash for e in entries):
        raise ValueError(f"{first.name!r} has several writers; a whole-tensor post_hash cannot be merged")

    def added(field: str) -> str | None:
        values = [getattr(e, field) for e in entries]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"some writers of {first.name!r} give {field}, others do not")
        return combine(*values)

    return ParamEntry(
        **{
            **first.__dict__,
            "changed": sum(e.changed for e in entries),
            "files": [f for e in entries for f in e.files],
            "parts": [f for e in entries for f in (e.parts or [e.files])],
            **{k: added(k) for k in ("digest", "pre_digest", "post_digest")},
        }
    )


def write_atomic(path: Path, data: bytes, pace: Callable[[int], None] | None = None) -> None:
    """Write to `.tmp`, fsync, rename, fsync the directory: readers see all of it or nothing. `pace(n)`
    is called before each 4 MiB written (a `Throttle` modelling a slower link)."""
    tmp = path.with_name(path.name + ".tmp")
    view, chunk = memoryview(data), 4 << 20
    with open(tmp, "wb") as f:
        for a in range(0, len(view), chunk):
            if pace is not None:
                pace(min(chunk, len(view) - a))
            f.write(view[a : a + chunk])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    path = Path(directory) / MANIFEST_NAME
    write_atomic(path, manifest.model_dump_json(indent=1).encode())
    return path


def load_manifest(directory: str | os.PathLike, *, limits: Limits = Limits()) -> Manifest:
    with DeltaDir.open(directory) as d:
        return parse_manifest(d.read(MANIFEST_NAME, cap=limits.max_manifest_bytes))


def parse_manifest(data: bytes) -> Manifest:
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as e:
        raise FormatError(f"invalid manifest: {e}", file=MANIFEST_NAME) from None
