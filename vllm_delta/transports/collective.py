"""Collective transport: flush bytes broadcast to each engine's own group (`groups.py`: the trainer's rank 0
plus that engine's workers), so a refused, stalled or killed engine breaks only its own group. Per update a
handshake on the group's store comes first: rank 0 offers the update (version, manifest digest, flush names
and sizes), every engine rank checks it against its HTTP request's manifest, and only if all accept does
rank 0 say "go" and stream: a refusing engine never leaves the trainer blocked in a broadcast."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from vllm_delta.client import Reply
from vllm_delta.transports.base import SentDelta, Sink, Transport, TransportOptions
from vllm_delta.transports.groups import BACKENDS, Group, host_group, listen
from vllm_delta.wire import DeltaError, FlushBuilder
from vllm_delta.wire.errors import FormatError, IncompleteDeltaError, LimitError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FlushSpool:
    """Encoded flushes by name: in memory up to `window_bytes`, the rest in an unlinked temporary file
    (every flush is encoded before the handshake, and an anchor is the whole model), read with `pread`."""

    def __init__(self, window_bytes: int = 256 << 20) -> None:
        self.window_bytes = window_bytes
        self._flushes: dict[str, bytes | tuple[int, int]] = {}  # the bytes, or (offset, size) in the file
        self._file: Any = None  # a TemporaryFile: unlinked, gone with its descriptor whatever happens
        self.spilled_bytes = self.held_bytes = 0  # the file's size; in memory, at most `window_bytes`
        self._lock = threading.Lock()

    def add(self, name: str, data: bytes) -> None:
        with self._lock:
            if name in self._flushes:
                raise ValueError(f"flush {name!r} is already spooled")
            if self.held_bytes + len(data) <= self.window_bytes:
                self._flushes[name] = bytes(data)
                self.held_bytes += len(data)
                return
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="vllm-delta-spool-")
            self._file.write(data)
            self._file.flush()  # before any thread preads it
            self._flushes[name] = (self.spilled_bytes, len(data))
            self.spilled_bytes += len(data)

    def read(self, name: str) -> bytes:
        held = self._flushes[name]
        if isinstance(held, bytes):
            return held
        offset, size = held
        data = b""
        while len(data) < size:  # a pread may return fewer bytes than asked
            got = os.pread(self._file.fileno(), size - len(data), offset + len(data))
            if not got:
                raise OSError(f"spool file ended at {offset + len(data)}, flush {name!r} needs {size} B")
            data += got
        return data

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        for name in list(self._flushes):
            yield name, self.read(name)

    def close(self) -> None:
        with self._lock:
            self._flushes.clear()
            self.held_bytes = 0
            if self._file is not None:
                self._file.close()
                self._file = None


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest as JSON with sorted keys, the same on both ends of the HTTP request."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Refused(DeltaError):
    """Another rank of this engine refused the offer (its status, type and fields are kept)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        why = f"{answer['type']} on another rank: {answer['message']}"
        super().__init__(why, file=answer.get("file"), param=answer.get("param"))
        self.http_status = int(answer["status"])


class CollectiveError(DeltaError):
    """The group broke (a peer left, a timeout): this engine drops it; the trainer rebuilds it."""

    http_status = 502


def offer(
    group: Group,
    version: int,
    manifest: dict[str, Any],
    flushes: Iterable[tuple[str, int]],
    stop: Callable[[], bool],
) -> bool:
    """Announce one update and collect the answers: True, every rank accepted (now stream); False, a rank
    refused or the engine answered its HTTP request without taking part (`stop()`); else `GroupTimeout`."""
    group.seq += 1
    group.bytes_sent, group.refusal = 0, None
    seq = group.seq
    offered = {"version": version, "manifest_sha256": manifest_digest(manifest)}
    group.put(f"{seq}/offer", offered | {"flushes": [list(f) for f in flushes]})
    keys = [f"{seq}/answer/{r}" for r in range(1, group.spg.world_size)]
    answers = group.wait_all(keys, time.monotonic() + group.timeout_s, stop)
    if answers is None:
        return False
    refusal = group.refusal = next((a for a in answers if not a["ok"]), None)
    group.put(f"{seq}/go", {"go": refusal is None, "refusal": refusal})
    return refusal is None


def stream(group: Group, flushes: Iterable[bytes]) -> None:
    """After `offer` said go: each flush, in the offered order."""
    for data in flushes:
        group.send_bytes(data)


class Receiver:
    """The offered flushes, received one at a time as the decoder asks for them."""

    def __init__(self, group: Group, flushes: list[tuple[str, int]]) -> None:
        self.group, self.flushes, self.received = group, flushes, 0

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        while self.received < len(self.flushes):
            name, size = self.flushes[self.received]
            data = self.group.recv_bytes(size)
            self.received += 1
            yield name, data

    def drain(self) -> None:
        """Receive and drop what the decoder did not take, so rank 0's stream ends."""
        for _ in self:
            pass


def answer(
    group: Group, manifest: dict[str, Any], version: int, max_flush_bytes: int, check: Callable[[], T]
) -> tuple[Receiver, T]:
    """Wait for rank 0's offer, check it (sizes, then `check()`: parse, lineage, version), answer, and
    wait for the go. Raises what this rank refused with, or `Refused` when another rank refused."""
    group.seq += 1
    seq = group.seq
    try:
        flushes = _check_offer(group.get(f"{seq}/offer"), manifest, version, max_flush_bytes)
        checked = check()
    except Exception as exc:  # every refusal is answered, so rank 0 never waits on this rank
        refusal = {"ok": False, "status": getattr(exc, "http_status", 400), "type": type(exc).__name__}
        refusal |= {"message": str(getattr(exc, "reason", exc)), "file": getattr(exc, "file", None)}
        group.put(f"{seq}/answer/{group.rank}", refusal | {"param": getattr(exc, "param", None)})
        raise
    group.put(f"{seq}/answer/{group.rank}", {"ok": True})
    go = group.get(f"{seq}/go")
    if not go["go"]:
        raise Refused(go["refusal"])
    return Receiver(group, flushes), checked


def _check_offer(
    got: dict[str, Any], manifest: dict[str, Any], version: int, max_flush_bytes: int
) -> list[tuple[str, int]]:
    try:
        if got["manifest_sha256"] != manifest_digest(manifest) or got["version"] != version:
            raise IncompleteDeltaError("the trainer's offer is for another manifest than this request's")
        flushes = [(str(n), int(s)) for n, s in got["flushes"]]
        stated = [(f["name"], int(f["bytes"])) for f in manifest.get("files", [])]
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
        raise FormatError("malformed offer, or a manifest whose files are not name and size") from None
    if flushes != stated:
        why = f"the offer lists {len(flushes)} flushes, not the manifest's {len(stated)}"
        raise IncompleteDeltaError(why)
    for name, size in flushes:
        if size > max_flush_bytes:
            why = f"flush of {size} B exceeds this engine's {max_flush_bytes} B per-flush cap"
            raise LimitError(why, file=name)
    return flushes


def _failed(url: str, exc: BaseException, kind: str) -> Reply:
    return Reply(url, 0, {"error": {"type": kind, "message": f"{type(exc).__name__}: {exc}"}})


class CollectiveLink:
    """The trainer's end of one engine's group: `connect()` through the engine's init route, `send()`."""

    def __init__(self, url: str, client: Any, transport: CollectiveTransport) -> None:
        self.url, self.client, self.transport = url, client, transport
        self.group: Group | None = None
        self.bytes_sent = 0  # bulk bytes the last update moved to this engine
        self.refusal: dict[str, Any] | None = None  # this engine's refusal of the last offer, if any

    def connect(self) -> None:
        """Rendezvous with every worker of the engine; `ConnectionError` if it refuses or stays away."""
        status = self.client.status([self.url])[self.url]
        if not status.ok:
            raise ConnectionError(f"{self.url}: status {status.status}: {status.error}")
        t, world = self.transport, 1 + len(status.body["ranks"])
        sock = listen(t.master_addr)
        body = {"master_addr": t.master_addr, "master_port": sock.getsockname()[1], "world_size": world}
        body |= {"rank_offset": 1, "backend": t.backend, "timeout_s": t.timeout_s}
        pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-delta-init")
        init = pool.submit(self.client.collective_init, {self.url: body})
        refused = lambda: init.done() and not init.result()[self.url].ok  # noqa: E731
        try:
            group = host_group(
                sock, world_size=world, backend=t.backend, timeout_s=t.timeout_s, refused=refused
            )
        except BaseException as exc:
            sock.close()
            pool.shutdown(wait=False)  # a worker still joining gives up at its own timeout
            if not refused():
                raise ConnectionError(f"{self.url}: collective init: {exc}") from exc
            reply = init.result()[self.url]
            raise ConnectionError(f"{self.url}: collective init {reply.status}: {reply.error}") from None
        try:  # every rank has joined; an engine that then stops answering HTTP is given up on in time
            reply = init.result(timeout=t.timeout_s)[self.url]
        except FutureTimeout:
            reply = None
        finally:
            pool.shutdown(wait=False)
        if reply is None or not reply.ok:
            group.close()
            why = f" {reply.status}: {reply.error}" if reply else f": no answer within {t.timeout_s:.0f} s"
            raise ConnectionError(f"{self.url}: collective init{why}")
        self.group = group

    def send(self, sent: SentDelta, body: dict[str, Any]) -> Reply:
        """One update: the HTTP request, the offer, and (if every rank accepts) the flushes; the engine's
        reply is the result. A broken or refused group is dropped (rebuilt at the next sync)."""
        group = self.group
        assert group is not None, "connect() first"
        manifest = sent.manifest.model_dump(mode="json")
        flushes = [(f.name, f.bytes) for f in sent.manifest.files]
        request = {self.url: {"transport": "collective", "manifest": manifest, **body}}
        with ThreadPoolExecutor(1, thread_name_prefix="vllm-delta-update") as pool:
            http = pool.submit(self.client.update, request)
            try:
                if offer(group, body["version"], manifest, flushes, stop=http.done):
                    stream(group, (sent.spool.read(name) for name, _ in flushes))
            except Exception as exc:  # a dead or stalled engine: its own reply says how it ended
                logger.warning("delta sender: collective send to %s failed: %s", self.url, exc)
                self.close()
            self.bytes_sent, self.refusal = group.bytes_sent, group.refusal
            reply = http.result()[self.url]
        if not reply.ok:
            self.close()
        return reply

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


class CollectiveTransport(Transport):
    """The same flush bytes, broadcast to each engine's group; the manifest goes in the HTTP request, so
    there is nothing to prepare, finish or seal."""

    stored = False  # flushes live in rank 0's spool; other ranks send theirs there

    def __init__(self, name: str, options: TransportOptions) -> None:
        """`name` is the backend: "gloo" or "nccl"."""
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {name!r}")
        self.backend, self.master_addr = name, options.master_addr
        self.timeout_s = options.collective_timeout_s
        self._links: dict[str, CollectiveLink] = {}

    def sink(self, name: str, **kwargs) -> Sink:
        spool = FlushSpool()
        return Sink(FlushBuilder(lambda file, enc: spool.add(file, enc.data), **kwargs), spool=spool)

    def link(self, url: str, client: Any) -> CollectiveLink:
        return self._links.setdefault(url, CollectiveLink(url, client, self))

    def push(self, client: Any, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        """Every engine at once, each on its own thread and group."""
        if not targets:
            return {}
        with ThreadPoolExecutor(len(targets), thread_name_prefix="vllm-delta-engine") as pool:
            futures = {u: pool.submit(self._push_one, client, u, s, body) for u, (s, body) in targets.items()}
            return {u: f.result() for u, f in futures.items()}

    def _push_one(self, client: Any, url: str, sent: SentDelta, body: dict) -> Reply:
        link = self.link(url, client)
        if link.group is None:
            try:
                link.connect()
            except Exception as exc:  # this engine misses this version; the next sync retries
                return _failed(url, exc, "CollectiveInitError")
        try:
            return link.send(sent, body)
        except Exception as exc:
            link.close()
            return _failed(url, exc, "CollectiveSendError")

    def cleanup(self, sent: list[SentDelta]) -> None:
        for s in sent:
            if s.spool is not None:
                s.spool.close()

    def close(self, url: str | None = None) -> None:
        for u in [url] if url is not None else list(self._links):
            link = self._links.pop(u, None)
            if link is not None:
                link.close()
