"""Disk transport: flush files in a version directory, written by a background thread, manifest last.

Why this order: each flush is written atomically (`.tmp`, fsync, rename) while the sender encodes
the next one; the manifest is written only after every flush is on disk, so a sender that dies
mid-write leaves a directory without a manifest, which every engine refuses (IncompleteDeltaError).
Multi-rank senders write their own flush files and rank 0 writes the merged manifest.

The engine's half is the wire format's own reader (`wire.open_delta` over a `DeltaDir` opened under
the engine's `--delta-updates-root`): the files are already where the engine reads them.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from vllm_delta.client import EngineClient, Reply
from vllm_delta.transports.base import SentDelta, Transport, TransportOptions
from vllm_delta.wire import MANIFEST_NAME, EncodedFlush, FlushBuilder, Manifest, write_manifest
from vllm_delta.wire.manifest import write_atomic


class Throttle:
    """Caps the write rate (bytes per second), to model a slower link in benchmarks."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate, self.start, self.sent = float(bytes_per_s), None, 0

    def wait(self, nbytes: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        self.sent += nbytes
        ahead = self.sent / self.rate - (time.perf_counter() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def throttled_write(path: Path, data: bytes, throttle: Throttle | None, chunk: int = 4 << 20) -> None:
    """`write_atomic`, with the bytes paced through `throttle` if one is given."""
    if throttle is None:
        write_atomic(path, data)
        return
    import os

    tmp = path.with_name(path.name + ".tmp")
    view = memoryview(data)
    with open(tmp, "wb") as f:
        for a in range(0, len(view), chunk):
            throttle.wait(min(chunk, len(view) - a))
            f.write(view[a:a + chunk])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BackgroundFlushWriter:
    """Hands each flush to `write(name, data)` on a background thread, so the sender encodes the next
    one meanwhile; `emit` blocks only if `depth` are queued. The first error stops the writes and is
    raised, as it was, by the next `emit` or by `close`. Both transports write through one of these:
    to a file (`file_writer`) or to an object store (transports/s3.py)."""

    def __init__(self, write: Callable[[str, bytes], None], *, depth: int = 2, name: str = "vllm-delta-writer"
                 ) -> None:
        self._write = write
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self.write_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is not None:
                continue
            name, data = item
            try:
                t = time.perf_counter()
                self._write(name, data)
                self.write_s += time.perf_counter() - t
            except BaseException as exc:  # reported by emit() or close()
                self._error = exc

    def emit(self, name: str, flush: EncodedFlush) -> None:
        if self._error is not None:
            raise self._error
        self._q.put((name, flush.data))

    def close(self) -> None:
        """Wait until every queued flush is written; raise the writer's error if it had one."""
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def file_writer(directory: Path, throttle: Throttle | None = None) -> BackgroundFlushWriter:
    """Flush files in `directory`, each written atomically (and paced through `throttle`)."""
    return BackgroundFlushWriter(lambda name, data: throttled_write(Path(directory) / name, data, throttle))


def prepare_version_dir(path: Path) -> Path:
    """An empty version directory; a leftover one (e.g. from a sender that died) is replaced."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def seal(path: Path, manifest: Manifest) -> int:
    """Write the manifest last; returns its size in bytes."""
    return write_manifest(path, manifest).stat().st_size


def remove_version_dir(path: Path) -> None:
    """Delete a delivered version directory, manifest first so no reader sees it as finished."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


class DiskTransport(Transport):
    """Flush files under `delta_dir/<version dir>`, one HTTP push per engine naming that directory."""

    stored = True  # every rank writes into the same directory; rank 0 seals it

    def __init__(self, delta_dir: Path, *, throttle_bytes_per_s: float | None = None, keep: bool = False) -> None:
        self.delta_dir, self.keep = Path(delta_dir), keep
        self.throttle_bytes_per_s = throttle_bytes_per_s

    @classmethod
    def create(cls, name: str, options: TransportOptions) -> DiskTransport:
        if options.delta_dir is None:
            raise ValueError("the disk transport needs delta_dir")
        return cls(Path(options.delta_dir), throttle_bytes_per_s=options.throttle_bytes_per_s,
                   keep=options.keep)

    def prepare(self, name: str) -> None:
        """Rank 0, before any rank writes: an empty version directory."""
        prepare_version_dir(self.delta_dir / name)

    def builder(self, name: str, **kwargs) -> FlushBuilder:
        throttle = Throttle(self.throttle_bytes_per_s) if self.throttle_bytes_per_s else None
        writer = file_writer(self.delta_dir / name, throttle)
        b = FlushBuilder(writer.emit, **kwargs)
        b.writer, b.location = writer, str(self.delta_dir / name)
        return b

    def finish(self, b: FlushBuilder) -> None:
        b.writer.close()  # every flush of this rank is on disk

    def seal(self, sent: SentDelta) -> None:
        seal(Path(sent.location), sent.manifest)

    def push(self, client: EngineClient, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        return client.update({u: {"path": Path(s.location).name, **body} for u, (s, body) in targets.items()})

    def cleanup(self, sent: list[SentDelta]) -> None:
        if not self.keep:
            for s in sent:
                remove_version_dir(Path(s.location))
