"""The manifest: written last and atomically, it is what makes a version directory a delta. It lists
every flush file (size, hash) and every changed param (dtype, shape, count, files in order, digests).
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Callable
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from .additive import DIGEST_ALGO, combine
from .container import Limits, json_loads
from .digest import HASH_ALGO
from .errors import FormatError, IncompleteDeltaError, LimitError, VersionError

MANIFEST_NAME = "manifest.json"
FORMAT: Final = "vllm-delta/1"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

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
    """Which weights an update may be applied to: versions `min_version`..`max_version` of run `run_id`.

    Why: a version number alone does not say whose weights an engine holds (a restarted engine, another
    sender). Both bounds None: a full anchor, valid on any weights; it puts the engine on `run_id`.
    """

    run_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    min_version: NonNeg | None = None
    max_version: NonNeg | None = None

    @model_validator(mode="after")
    def _range(self) -> Lineage:
        if (self.min_version is None) != (self.max_version is None):
            raise ValueError("lineage: give both min_version and max_version, or neither (an anchor)")
        lo, hi = self.min_version, self.max_version
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"lineage: min_version {self.min_version} > max_version {self.max_version}")
        return self

    @property
    def any_version(self) -> bool:
        return self.min_version is None


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
    # Set by a sender given signing keys; an unsigned manifest serializes without it (`_as_before`).
    signature: Signature | None = None

    @model_serializer(mode="wrap")
    def _as_before(self, handler: SerializerFunctionWrapHandler) -> dict:
        """No `signature` key when unsigned: unsigned manifests keep their bytes, older engines read them."""
        out = handler(self)
        if out.get("signature", 0) is None:
            del out["signature"]
        return out

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
    first = parts[0]
    for p in parts[1:]:
        if (p.version, p.base_version, p.encoding, p.lineage) != (
            first.version,
            first.base_version,
            first.encoding,
            first.lineage,
        ):
            raise ValueError("manifests disagree on version, base_version, encoding or lineage")
    by_name: dict[str, list[ParamEntry]] = {}
    for p in parts:
        for e in p.params:
            by_name.setdefault(e.name, []).append(e)
    return Manifest(
        version=first.version,
        base_version=first.base_version,
        encoding=first.encoding,
        model_elements=first.model_elements,
        files=[f for p in parts for f in p.files],
        params=[_merge_entries(es) for es in by_name.values()],
        lineage=first.lineage,
    )


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
        name=first.name,
        dtype=first.dtype,
        shape=first.shape,
        changed=sum(e.changed for e in entries),
        files=[f for e in entries for f in e.files],
        parts=[f for e in entries for f in (e.parts or [e.files])],
        digest=added("digest"),
        pre_digest=added("pre_digest"),
        post_digest=added("post_digest"),
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
    path = Path(directory) / MANIFEST_NAME
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IncompleteDeltaError("no manifest: the delta is unfinished", file=MANIFEST_NAME) from None
    if size > limits.max_manifest_bytes:
        raise LimitError(f"manifest of {size} B exceeds {limits.max_manifest_bytes} B", file=MANIFEST_NAME)
    return parse_manifest(path.read_bytes())


def parse_manifest(data: bytes) -> Manifest:
    """Validate manifest JSON: its params as columns where the schema would take every entry as it is
    (`_entries`); anything else is the model's to decide, with the same result."""
    try:
        raw = json_loads(data)
        entries = _entries(raw.get("params")) if type(raw) is dict else None
        if entries is not None:
            try:
                return Manifest.model_validate({**raw, "params": entries})
            except ValidationError:
                pass  # the error names the JSON's own entries: the model's validation of it raises it
        return Manifest.model_validate(raw)
    except (ValueError, ValidationError) as e:
        raise FormatError(f"invalid manifest: {e}", file=MANIFEST_NAME) from None


_PARAM_FIELDS = tuple(ParamEntry.model_fields)  # in the order write_manifest writes them (model_dump)
_COLUMNS = tuple(map(itemgetter, _PARAM_FIELDS))
_NONE = type(None)
_setattr = object.__setattr__


def _entries(params: object) -> list[ParamEntry] | None:
    """A manifest's params as `ParamEntry`s made without a validation each (what `model_validate` would
    make), when every entry is a dict of exactly the model's fields in `write_manifest`'s order, of exact
    types its schema takes as they are; else None, and pydantic decides.

    Why: one validated model a tensor was ~2.1 us of prepare's fixed cost at 44k tensors.
    """
    if type(params) is not list or not params or set(map(type, params)) != {dict}:
        return None
    if set(map(tuple, params)) != {_PARAM_FIELDS}:
        return None
    name, dtype, shape, changed, files, parts, *digests = (list(map(g, params)) for g in _COLUMNS)
    if set(map(type, shape)) | set(map(type, files)) != {list}:
        return None  # (before chaining them: a number is not iterable)
    dims = list(chain.from_iterable(shape))
    if (
        set(map(type, name)) | set(map(type, dtype)) != {str}
        or not set(map(type, dims)) <= {int}
        or (dims and min(dims) < 0)
        or set(map(type, changed)) != {int}
        or min(changed) < 1
        or min(map(len, files)) < 1
        or set(map(type, chain.from_iterable(files))) != {str}
        or not set(map(type, chain.from_iterable(digests))) <= {str, _NONE}
    ):
        return None
    if set(map(type, parts)) != {_NONE} and not all(map(_lists_of_str, parts)):
        return None
    n = len(params)
    made = list(map(object.__new__, repeat(ParamEntry, n)))
    # One fields-set shared by the entries: pydantic never changes a frozen model's in place.
    for attr, value in (
        ("__dict__", params),
        ("__pydantic_fields_set__", repeat(set(_PARAM_FIELDS), n)),
        ("__pydantic_extra__", repeat(None, n)),
        ("__pydantic_private__", repeat(None, n)),
    ):
        deque(map(_setattr, made, repeat(attr), value), 0)
    return made


def _lists_of_str(parts: object) -> bool:
    """`parts` is None or lists of str (that they partition the files is the model validator's check)."""
    return parts is None or (
        type(parts) is list
        and set(map(type, parts)) <= {list}
        and set(map(type, chain.from_iterable(parts))) <= {str}
    )
