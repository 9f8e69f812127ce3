"""The byte layers of a delta, bounded: files in a version directory (`DeltaDir`), safetensors, zstd.
Every header size, offset and decompressed size is checked against a limit before any allocation."""

from __future__ import annotations

import errno
import gc
import io
import json
import math
import os
import stat
import struct
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic_core
import zstandard

from .dtypes import DType, by_st_code
from .errors import FormatError, IncompleteDeltaError, IntegrityError, LimitError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_local = threading.local()
_gc_lock = threading.Lock()
_gc_holders = 0  # threads inside paused_gc
_gc_was_enabled = False  # collection's state when the first of them entered


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd context: making one costs ~15 us, and a flush at 44k tensors holds ~100k frames."""
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic collection inside (counted across threads): parsing metadata's few objects a tensor starts
    hundreds of whole-heap collections at 44k tensors (6k tensors: 20 ms paused, 150 ms not)."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def json_loads(text: str | bytes) -> Any:
    """`json.loads`'s values and errors, ~1.5x faster (pydantic-core's parser; what it refuses goes to
    `json.loads`, whose RecursionError is a `JSONDecodeError` here)."""
    try:
        return pydantic_core.from_json(text, cache_strings="keys")
    except ValueError:
        pass
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None


@dataclass(frozen=True)
class Limits:
    """Caps for untrusted input. Manifest-declared sizes tighten these; they never loosen them."""

    max_header_bytes: int = 64 << 20
    max_manifest_bytes: int = 128 << 20
    # Decompression cap of a flush when no manifest says better (seed deltas).
    max_decoded_bytes: int = 4 << 30
    # Decoded bytes the manifest allows the flushes decoded at once (reader.iter_delta's threads) in all.
    max_decoded_at_once: int = 4 << 30


@dataclass(frozen=True)
class RawTensor:
    dtype: DType
    shape: tuple[int, ...]
    data: memoryview


class DeltaDir:
    """An open version directory: files opened relative to its handle, never through a symlink, only when
    regular. Why: a symlink swapped in after the API server's check is refused; a FIFO cannot block a read."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> DeltaDir:
        """With `root`, `path` (relative, or absolute under `root`) is walked from the root's handle and no
        component of it may be a symlink."""
        path = Path(path)
        if root is None:
            return cls(_open_dir(os.fspath(path), None, follow=True, shown=path), path)
        root = Path(root)
        rel = Path(os.path.relpath(path, root)) if path.is_absolute() else path
        if any(part in ("..", ".") for part in rel.parts) or rel.is_absolute():
            raise FormatError(f"{os.fspath(path)!r} is not a plain path inside the root")
        fd = _open_dir(os.fspath(root), None, follow=True, shown=root)
        try:
            for part in rel.parts:
                child = _open_dir(part, fd, follow=False, shown=rel)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, root / rel)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> DeltaDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def has(self, name: str) -> bool:
        """Whether an entry called `name` exists (of any type: reading it checks the type)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def read(self, name: str, *, size: int | None = None, cap: int) -> bytes:
        """The bytes of regular file `name`: exactly `size` of them when given, at most `cap`."""
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise FormatError("is not a plain file name inside the version directory", file=name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise IncompleteDeltaError("file named by the delta is missing", file=name) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FormatError(
                    "is a symlink; delta files are never read through links", file=name
                ) from None
            if e.errno == errno.ENXIO:  # a Unix socket (or a FIFO's other end): nothing to read
                raise FormatError("is not a regular file", file=name) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError("is not a regular file", file=name)
            if size is not None and st.st_size != size:
                raise IntegrityError(
                    f"{st.st_size} B on disk, manifest says {size} B (truncated?)", file=name
                )
            if st.st_size > cap:
                raise LimitError(f"{st.st_size} B exceeds the {cap} B limit", file=name)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(st.st_size + 1)
        finally:
            os.close(fd)
        if len(data) != st.st_size:
            raise IntegrityError("file changed size while it was read", file=name)
        return data


class SparseFile(bytearray):
    """A file of which only some ranges were fetched (the rest zero): the decoder cannot check its hash."""


def _open_dir(name: str, dir_fd: int | None, *, follow: bool, shown: Path) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise IncompleteDeltaError(f"{shown} is not a directory") from None
    except NotADirectoryError:  # also what O_NOFOLLOW | O_DIRECTORY says of a symlink
        if not follow and stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise FormatError(
                f"{shown}: {name!r} is a symlink; the path is never followed through links"
            ) from None
        raise IncompleteDeltaError(f"{shown} is not a directory") from None


def pack(blobs: dict[str, bytes], metadata: dict[str, str]) -> bytes:
    """A safetensors file of 1-D uint8 tensors, laid out as the `safetensors` library lays it out, but
    with the `__metadata__` keys sorted (the library writes them from a hash map, in an order that differs
    between processes): the same delta gives the same bytes, and file hash, in every process."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    names, at = sorted(blobs), 0
    for k in names:
        header[k] = {"dtype": "U8", "shape": [len(blobs[k])], "data_offsets": [at, at + len(blobs[k])]}
        at += len(blobs[k])
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(blobs[k] for k in names)])


def unpack(
    data: bytes | bytearray | memoryview, *, file: str | None, limits: Limits
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
        header = json_loads(bytes(view[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"safetensors header is not JSON: {e}", file=file) from None
    if not isinstance(header, dict):
        raise FormatError("safetensors header is not an object", file=file)
    body = view[8 + n :]
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("safetensors metadata is not a string map", file=file)
    tensors = {}
    for name, entry in header.items():
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = type(code) is str and all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise FormatError(f"bad safetensors entry for {name!r}", file=file)
        d = by_st_code(code, file=file)
        if not begin <= end <= len(body):
            raise FormatError(f"tensor {name!r} lies outside the file (truncated?)", file=file)
        if end - begin != math.prod(shape) * d.itemsize:
            raise FormatError(f"tensor {name!r}: byte span does not match its shape", file=file)
        tensors[name] = RawTensor(d, shape, body[begin:end])
    return tensors, metadata


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd context at `level` (~17 us to make); each `compress` starts a fresh frame, the
    bytes of a fresh context's."""
    made = _local.__dict__.setdefault("cctx", {})
    if level not in made:
        made[level] = zstandard.ZstdCompressor(level=level)
    return made[level]


def compress(data: bytes, level: int) -> bytes:
    return compressor(level).compress(data)


def decompress(
    data: bytes | bytearray | memoryview,
    cap: int,
    *,
    exact: int | None = None,
    file: str | None = None,
    what: str = "payload",
    param: str | None = None,
) -> bytes | bytearray:
    """Decompress one zstd frame, never producing more than `cap` bytes (zstd-bomb safe); one-shot when
    the frame states its size (checked against `cap` and `exact` first)."""
    try:
        declared = zstandard.get_frame_parameters(data[:18]).content_size
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: not a zstd frame: {e}", file=file, param=param) from None
    declared = -1 if declared == zstandard.CONTENTSIZE_UNKNOWN else declared
    if declared > cap:
        raise LimitError(f"{what}: zstd frame declares {declared} B, limit {cap} B", file=file, param=param)
    if exact is not None and declared not in (-1, exact):
        raise FormatError(
            f"{what}: zstd frame declares {declared} B, expected {exact} B", file=file, param=param
        )
    if declared >= 0:
        try:
            return decompressor().decompress(data, max_output_size=declared, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise FormatError(f"{what}: corrupt zstd data: {e}", file=file, param=param) from None
    out = bytearray()
    try:
        with decompressor().stream_reader(io.BytesIO(data)) as reader:
            while chunk := reader.read(min(1 << 22, cap + 1 - len(out))):
                out += chunk
                if len(out) > cap:
                    raise LimitError(f"{what}: decompresses past the {cap} B limit", file=file, param=param)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: corrupt zstd data: {e}", file=file, param=param) from None
    if exact is not None and len(out) != exact:
        raise FormatError(f"{what}: decompressed to {len(out)} B, expected {exact} B", file=file, param=param)
    return out
