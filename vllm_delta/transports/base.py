"""What every transport is: the `Transport` interface the publisher drives, the options a sender gives it,
what one delta put on the wire, the stored transports' common half, and the registry by name."""

from __future__ import annotations

import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_delta.wire import EncodedFlush, FlushBuilder, Manifest

if TYPE_CHECKING:  # the client needs aiohttp, which the transports' engine halves do not
    from vllm_delta.client import EngineClient, Reply
    from vllm_delta.transports.collective import FlushSpool

# Imported only when one is created (as vLLM's weight-transfer `factory.py`): s3 needs boto3, the
# collective one torch.distributed and vLLM's groups; a sender writing to disk neither.
REGISTRY = {
    "disk": ("vllm_delta.transports.disk", "DiskTransport"),
    "s3": ("vllm_delta.transports.s3", "S3Transport"),
    "gloo": ("vllm_delta.transports.collective", "CollectiveTransport"),
    "nccl": ("vllm_delta.transports.collective", "CollectiveTransport"),
}


@dataclass
class SentDelta:
    """What one delta (a version, for one group of engines) put on the wire."""

    kind: str  # "delta" | "catchup" | "anchor"
    manifest: Manifest
    flushes: int
    wire_bytes: int  # encoded bytes (after compression)
    pre_compress_bytes: int  # the same flushes before compression
    location: str | None = None  # the version dir's name (disk, s3)
    spool: FlushSpool | None = None  # the encoded flushes, for a collective


@dataclass(eq=False)
class Sink:
    """Where one rank's flushes of one version go: the builder that encodes them, and what moves each
    on (a background writer of files or objects, or a spool for a broadcast)."""

    builder: FlushBuilder
    location: str | None = None  # the version dir's name (disk, s3)
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


def create(name: str, options: TransportOptions) -> Transport:
    """The transport `name`, built from `options`; ValueError for an unknown name or unfit options."""
    if name not in REGISTRY:
        raise ValueError(f"transport must be one of {tuple(REGISTRY)}, not {name!r}")
    module, class_name = REGISTRY[name]
    cls: type[Transport] = getattr(importlib.import_module(module), class_name)
    return cls(name, options)


class Transport(ABC):
    """How one publish's flushes reach the engines, in the order the publisher calls it: `prepare`
    (rank 0), then per rank `sink` and `finish`, then on rank 0 `seal`, `push` and `cleanup`."""

    # True: every rank writes its flushes once into one shared place that rank 0 seals and every engine
    # reads. False: rank 0 gathers them and sends them to each engine (once per engine).
    stored: bool
    uploaded_bytes: int | None = None  # bytes uploaded so far, where the transport counts them (s3)

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


class StoredTransport(Transport):
    """Flushes under a version dir that every rank writes into and rank 0 seals (disk, s3), each written
    by a background thread while the next is encoded; one HTTP push per engine names the dir."""

    stored = True

    @abstractmethod
    def writer(self, name: str) -> Callable[[str, bytes], None]:
        """What writes each flush (file name, bytes) of version dir `name`."""

    def sink(self, name: str, **kwargs: Any) -> Sink:
        writer = BackgroundFlushWriter(self.writer(name))
        return Sink(FlushBuilder(writer.emit, **kwargs), name, writer=writer)

    def push(self, client: EngineClient, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        return client.update({u: {"path": s.location, **body} for u, (s, body) in targets.items()})


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
    """Hands each flush to `write(name, data)` on a thread, so the sender encodes the next meanwhile;
    `emit` blocks while two are held. The first error stops the writes; `emit` or `close` raises it."""

    def __init__(self, write: Callable[[str, bytes], None]) -> None:
        self._write, self._slots = write, threading.BoundedSemaphore(2)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-delta-writer")
        self._error: BaseException | None = None
        self.write_s = 0.0

    def _run(self, name: str, data: bytes) -> None:
        try:
            if self._error is None:
                t = time.perf_counter()
                self._write(name, data)
                self.write_s += time.perf_counter() - t
        except BaseException as exc:  # raised by emit() or close()
            self._error = exc
        finally:
            self._slots.release()

    def emit(self, name: str, flush: EncodedFlush) -> None:
        if self._error is not None:
            raise self._error
        self._slots.acquire()
        self._pool.submit(self._run, name, flush.data)

    def close(self) -> None:
        """Wait until every flush handed over is written; raise the writer's error if it had one."""
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise self._error
