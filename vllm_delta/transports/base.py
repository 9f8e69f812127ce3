"""What every transport is: the `Transport` interface the publisher drives, the options a sender gives
it, `SentDelta` (what one delta put on the wire), and the background writer of the stored transports.
A `Sink` takes each flush `FlushBuilder` encodes as it comes, so encoding the next overlaps moving it."""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_delta.wire import EncodedFlush, FlushBuilder, Manifest

if TYPE_CHECKING:  # the client needs aiohttp, which the transports' engine halves do not
    from vllm_delta.client import EngineClient, Reply
    from vllm_delta.transports.collective import FlushSpool


@dataclass
class SentDelta:
    """What one delta (a version, for one group of engines) put on the wire."""

    kind: str  # "delta" | "catchup" | "anchor"
    manifest: Manifest
    flushes: int
    wire_bytes: int  # encoded bytes (after compression)
    pre_compress_bytes: int  # the same flushes before compression
    encode_s: float = 0.0
    location: str | None = None  # version directory (disk, s3)
    spool: FlushSpool | None = None  # the encoded flushes, for a collective


@dataclass(eq=False)
class Sink:
    """Where one rank's flushes of one version go: the builder that encodes them, and what moves each
    on as it comes (a background writer of files or objects, or a spool for a broadcast)."""

    builder: FlushBuilder
    location: str | None = None  # the version directory (disk), or its name under the store prefix (s3)
    writer: BackgroundFlushWriter | None = None
    spool: FlushSpool | None = None


@dataclass(frozen=True)
class TransportOptions:
    """The `DeltaSender` arguments a transport may use; each takes what it needs and checks it."""

    delta_dir: str | Path | None = None
    keep: bool = False
    throttle_bytes_per_s: float | None = None
    version: int = 0  # the sender's start version
    master_addr: str = "127.0.0.1"
    collective_timeout_s: float = 120.0
    planner: Any = None  # sender.planner.Planner: which engines acknowledged what (the s3 lifecycle)


class Transport(ABC):
    """How one publish's flushes reach the engines, in the order the publisher calls it: `prepare`
    (rank 0), then per rank `sink` and `finish`, then on rank 0 `seal`, `push` and `cleanup`."""

    # True: every rank writes its flushes once into one shared place (a directory, a store prefix)
    # that rank 0 seals and every engine reads. False: rank 0 gathers them and sends them to each
    # engine (a broadcast moves the bytes once per engine).
    stored: bool

    @abstractmethod
    def __init__(self, name: str, options: TransportOptions) -> None:
        """The transport registered as `name`, built from the sender's options (ValueError if they
        do not fit it)."""

    def prepare(self, name: str) -> None:
        """Rank 0, before any rank encodes: make version `name`'s place empty."""

    @abstractmethod
    def sink(self, name: str, **kwargs: Any) -> Sink:
        """A `Sink` whose flushes go where version `name` lives; `kwargs` are its `FlushBuilder`'s."""

    def finish(self, sink: Sink) -> None:
        """Every flush `sink` encoded has left this rank (raises its writer's error, if any)."""
        if sink.writer is not None:
            sink.writer.close()

    def seal(self, sent: SentDelta) -> None:
        """Rank 0: the merged manifest, last; only then may an engine see the version."""

    @abstractmethod
    def push(self, client: EngineClient, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        """Rank 0: one update request per engine URL (`SentDelta`, request body); their replies."""

    def cleanup(self, sent: list[SentDelta]) -> None:
        """Rank 0, after the push: drop what is no longer needed on the wire."""

    def close(self, url: str | None = None) -> None:
        """Drop what is held for engine `url` (every engine with None)."""

    def catch_up(self, status: dict[str, Any], target: int) -> list[dict[str, Any]] | None:
        """The kept versions that take an engine in `status` to `target`, as update bodies in order;
        None where nothing is kept (the planner anchors the engine instead)."""
        return None

    @property
    def uploaded_bytes(self) -> int | None:
        """Bytes this transport has uploaded so far, where it counts them (the object store)."""
        return None


class Throttle:
    """Caps the write rate (bytes per second): a slower link, for disk and s3 writes and the benchmarks."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate, self.start, self.sent = float(bytes_per_s), None, 0

    def wait(self, nbytes: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        self.sent += nbytes
        ahead = self.sent / self.rate - (time.perf_counter() - self.start)
        if ahead > 0:
            time.sleep(ahead)


class BackgroundFlushWriter:
    """Hands each flush to `write(name, data)` on a thread (a file for disk, an object for s3), so the
    sender encodes the next meanwhile; `emit` blocks only if `depth` are queued. The first error stops
    the writes and is raised by the next `emit` or by `close`."""

    def __init__(
        self, write: Callable[[str, bytes], None], *, depth: int = 2, name: str = "vllm-delta-writer"
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
