"""Collective transport: the same flush bytes as on disk, broadcast to each engine's own group.

Why one group per engine (the trainer's rank 0 plus that engine's workers; `groups.py`): a refused,
stalled or killed engine breaks only its own group, which is dropped and rebuilt at the next sync,
and the trainer's default process group is never touched. Engines are served concurrently, one
thread each, so one slow or refusing engine does not hold back the others.

Per update and engine (`handshake.py`): the HTTP request carries the manifest; rank 0 offers the
update on the group's control plane; the engine's ranks check it and answer; only on a go do the
flushes move, one at a time. The sender holds the encoded flushes in a spool whose memory is
bounded (`spool.py`); the engine decodes each flush as it arrives and drops it, so neither side
needs the whole delta in memory, and no total-size cap stops a large anchor (each flush is capped,
and the manifest states the total).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any

from vllm_delta.client import Reply
from vllm_delta.transports.base import SentDelta
from vllm_delta.transports.groups import BACKENDS, Group, host_group, listen
from vllm_delta.transports.handshake import offer, stream
from vllm_delta.transports.spool import DEFAULT_WINDOW_BYTES, FlushSpool
from vllm_delta.wire import FlushBuilder

logger = logging.getLogger(__name__)


def _failed(url: str, exc: BaseException, kind: str) -> Reply:
    return Reply(url, 0, {"error": {"type": kind, "message": f"{type(exc).__name__}: {exc}"}})


class CollectiveLink:
    """The trainer's end of one engine's group: `connect()` through the engine's init route, `send()`."""

    def __init__(self, url: str, client: Any, *, backend: str = "gloo", master_addr: str = "127.0.0.1",
                 timeout_s: float = 120.0) -> None:
        self.url, self.client, self.backend = url, client, backend
        self.master_addr, self.timeout_s = master_addr, timeout_s
        self.group: Group | None = None
        self.bytes_sent = 0  # bulk bytes the last update moved to this engine
        self.refusal: dict[str, Any] | None = None  # this engine's refusal of the last offer, if any

    def connect(self) -> None:
        """Rendezvous with every worker of the engine; `ConnectionError` if it refuses or stays away."""
        status = self.client.status([self.url])[self.url]
        if not status.ok:
            raise ConnectionError(f"{self.url}: status {status.status}: {status.error}")
        world = 1 + len(status.body["ranks"])
        sock = listen(self.master_addr)
        body = {"master_addr": self.master_addr, "master_port": sock.getsockname()[1], "world_size": world,
                "rank_offset": 1, "backend": self.backend, "timeout_s": self.timeout_s}
        pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-delta-init")
        init = pool.submit(self.client.collective_init, {self.url: body})
        try:
            group = host_group(sock, world_size=world, backend=self.backend, timeout_s=self.timeout_s,
                               joined=lambda: not init.done() or init.result()[self.url].ok)
        except BaseException as exc:
            sock.close()
            reply = init.result()[self.url] if init.done() else None
            pool.shutdown(wait=False)  # a worker still joining gives up at its own timeout
            if reply is not None and not reply.ok:
                raise ConnectionError(f"{self.url}: collective init {reply.status}: {reply.error}") from None
            raise ConnectionError(f"{self.url}: collective init: {exc}") from exc
        try:  # every rank has joined; an engine that then stops answering HTTP is given up on in time
            reply = init.result(timeout=self.timeout_s)[self.url]
        except FutureTimeout:
            group.close()
            raise ConnectionError(f"{self.url}: collective init: no answer within {self.timeout_s:.0f} s") from None
        finally:
            pool.shutdown(wait=False)
        if not reply.ok:
            group.close()
            raise ConnectionError(f"{self.url}: collective init {reply.status}: {reply.error}")
        self.group = group

    def send(self, sent: SentDelta, body: dict[str, Any]) -> Reply:
        """One update: the HTTP request, the offer, and (if every rank accepts) the flushes.

        The engine's HTTP reply is the result; a broken or refused group is dropped (rebuilt at the
        next sync), whatever the engine said.
        """
        if self.group is None:
            raise ConnectionError(f"{self.url}: not connected")
        group = self.group
        manifest = sent.manifest.model_dump(mode="json")
        flushes = [(f.name, f.bytes) for f in sent.manifest.files]
        pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-delta-update")
        http = pool.submit(self.client.update, {self.url: {"transport": "collective", "manifest": manifest, **body}})
        try:
            if offer(group, body["version"], manifest, flushes, stop=http.done):
                stream(group, (sent.spool.read(name) for name, _ in flushes))
        except Exception as exc:  # a dead or stalled engine: its own reply says how it ended
            logger.warning("delta sender: collective send to %s failed: %s", self.url, exc)
            self.close()
        self.bytes_sent, self.refusal = group.bytes_sent, group.refusal
        try:
            reply = http.result()[self.url]
        finally:
            pool.shutdown(wait=False)
        if not reply.ok:
            self.close()
        return reply

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


class CollectiveTransport:
    """The same flush bytes, broadcast to each engine's group; the manifest goes over HTTP."""

    shared_files = False  # flushes live in rank 0's spool; other ranks send theirs there

    def __init__(self, backend: str, *, master_addr: str = "127.0.0.1", timeout_s: float = 120.0,
                 window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend, self.master_addr, self.timeout_s = backend, master_addr, timeout_s
        self.window_bytes = window_bytes
        self._links: dict[str, CollectiveLink] = {}

    def prepare(self, name: str) -> None:
        """Nothing to create: each rank's builder has its own spool."""

    def builder(self, name: str, **kwargs) -> FlushBuilder:
        spool = FlushSpool(self.window_bytes)
        b = FlushBuilder(lambda file, enc: spool.add(file, enc.data), **kwargs)
        b.spool, b.location = spool, None
        return b

    def finish(self, b: FlushBuilder) -> None:
        """Every flush is already in `b.spool`."""

    def seal(self, sent: SentDelta) -> None:
        """The manifest travels in the update request."""

    def link(self, url: str, client: Any) -> CollectiveLink:
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = CollectiveLink(url, client, backend=self.backend,
                                                     master_addr=self.master_addr, timeout_s=self.timeout_s)
        return link

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
