"""Collective transport: the same flush bytes as on disk, broadcast over torch.distributed.

Why one small group per engine (the trainer's rank 0 plus that engine's workers) instead of one
world: a refused or restarted engine then breaks only its own group, which the sender rebuilds,
and the trainer's own default process group (Megatron, FSDP) is never touched. Groups are built
from a TCPStore directly (no `init_process_group`), gloo on CPU, NCCL on GPU.

Protocol per update, after the engine accepted the HTTP request carrying the manifest: rank 0
broadcasts the number of flushes, then their sizes (int64), then each flush's bytes (uint8). An
engine receives every flush before it checks anything, so a delta it refuses never leaves the
trainer blocked in a broadcast.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from vllm_delta.client import Reply
from vllm_delta.wire import FlushBuilder

logger = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl")


@dataclass
class Group:
    pg: Any
    store: Any
    rank: int
    world_size: int
    backend: str

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dev = t.to(self.device)
        self.pg.broadcast(dev, 0).wait()
        return dev.cpu() if dev.device.type != "cpu" else dev


def make_group(*, backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
               timeout_s: float, store: Any = None) -> Group:
    """Join (or, as rank 0 with `store`, create) a standalone process group."""
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return Group(pg, store, rank, world_size, backend)


def master_store(master_addr: str, world_size: int, timeout_s: float):
    """Rank 0's TCPStore on a free port (`store.port`)."""
    import torch.distributed as dist

    return dist.TCPStore(master_addr, 0, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def send_flushes(group: Group, buffers: list[bytes]) -> None:
    """Rank 0: broadcast the flushes (count, sizes, then bytes)."""
    group.broadcast(torch.tensor([len(buffers)], dtype=torch.int64))
    if not buffers:
        return
    group.broadcast(torch.tensor([len(b) for b in buffers], dtype=torch.int64))
    for b in buffers:
        group.broadcast(torch.frombuffer(bytearray(b), dtype=torch.uint8))


def recv_flushes(group: Group, max_total_bytes: int) -> list[bytes]:
    """Every other rank: receive what `send_flushes` broadcasts (bounded by `max_total_bytes`)."""
    n = int(group.broadcast(torch.zeros(1, dtype=torch.int64))[0])
    if n == 0:
        return []
    sizes = group.broadcast(torch.zeros(n, dtype=torch.int64)).tolist()
    if n < 0 or min(sizes) < 1 or sum(sizes) > max_total_bytes:
        raise ValueError(f"collective delta of {n} flushes, {sum(sizes)} B exceeds the limits")
    return [group.broadcast(torch.empty(s, dtype=torch.uint8)).numpy().tobytes() for s in sizes]


class CollectiveLink:
    """The trainer's end of one engine's group: `connect()` through the engine's init route, `send()`."""

    def __init__(self, url: str, client, *, backend: str = "gloo", master_addr: str = "127.0.0.1",
                 timeout_s: float = 120.0) -> None:
        self.url, self.client, self.backend = url, client, backend
        self.master_addr, self.timeout_s = master_addr, timeout_s
        self.group: Group | None = None

    def connect(self) -> None:
        status = self.client.status([self.url])[self.url]
        if not status.ok:
            raise ConnectionError(f"{self.url}: status {status.status}: {status.error}")
        world = 1 + len(status.body["ranks"])
        store = master_store(self.master_addr, world, self.timeout_s)
        body = {"master_addr": self.master_addr, "master_port": store.port, "world_size": world,
                "rank_offset": 1, "backend": self.backend, "timeout_s": self.timeout_s}
        replies: dict = {}
        t = threading.Thread(target=lambda: replies.update(self.client.collective_init({self.url: body})))
        t.start()
        try:
            group = make_group(backend=self.backend, master_addr=self.master_addr, master_port=store.port, rank=0,
                               world_size=world, timeout_s=self.timeout_s, store=store)
        finally:
            t.join()
        reply = replies[self.url]
        if not reply.ok:
            raise ConnectionError(f"{self.url}: collective init {reply.status}: {reply.error}")
        self.group = group

    def send(self, buffers: list[bytes]) -> None:
        if self.group is None:
            raise ConnectionError(f"{self.url}: not connected")
        try:
            send_flushes(self.group, buffers)
        except BaseException:
            self.group = None  # a failed collective leaves the group unusable: rebuild it next time
            raise

    def close(self) -> None:
        self.group = None


class CollectiveTransport:
    """The same flush bytes, broadcast to each engine's group; the manifest goes over HTTP."""

    shared_files = False  # one rank holds every flush in memory

    def __init__(self, backend: str, *, master_addr: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend, self.master_addr, self.timeout_s = backend, master_addr, timeout_s
        self._links: dict[str, CollectiveLink] = {}

    def prepare(self, name: str) -> None:
        """Nothing to create: flushes stay in memory until broadcast."""

    def builder(self, name: str, **kwargs) -> FlushBuilder:
        buffers: list[tuple[str, bytes]] = []
        b = FlushBuilder(lambda file, enc: buffers.append((file, enc.data)), **kwargs)
        b.buffers, b.location = buffers, None
        return b

    def finish(self, b: FlushBuilder) -> None:
        """Every flush is already in `b.buffers`."""

    def seal(self, sent: SentDelta) -> None:
        """The manifest travels in the update request."""

    def push(self, client, targets: dict[str, tuple[SentDelta, dict]]) -> dict[str, Reply]:
        replies: dict[str, Reply] = {}
        ready: dict[str, tuple[SentDelta, dict]] = {}
        for u, target in targets.items():
            link = self._links.get(u)
            if link is None or link.group is None:
                link = self._links[u] = CollectiveLink(u, client, backend=self.backend,
                                                       master_addr=self.master_addr, timeout_s=self.timeout_s)
                try:
                    link.connect()
                except Exception as exc:  # this engine misses this version; the next sync retries
                    replies[u] = Reply(u, 0, {"error": {"type": "CollectiveInitError", "message": str(exc)}})
                    continue
            ready[u] = target
        bodies = {u: {"transport": "collective", "manifest": s.manifest.model_dump(mode="json"), **body}
                  for u, (s, body) in ready.items()}
        out: dict[str, Reply] = {}
        t = threading.Thread(target=lambda: out.update(client.update(bodies)))
        t.start()
        for u, (s, _) in ready.items():
            try:
                self._links[u].send([data for _, data in s.buffers])
            except Exception as exc:
                logger.warning("delta sender: broadcast to %s failed: %s", u, exc)
        t.join()
        replies.update(out)
        for u, r in replies.items():
            if not r.ok and u in self._links:
                self._links[u].close()  # rebuild the group next time
        return replies

    def cleanup(self, sent: list[SentDelta]) -> None:
        """Buffers are dropped with the SentDelta."""

    def close(self, url: str | None = None) -> None:
        for u in [url] if url is not None else list(self._links):
            link = self._links.pop(u, None)
            if link is not None:
                link.close()
