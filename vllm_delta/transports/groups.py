"""One engine's collective group: vLLM's `StatelessProcessGroup` with a JSON control plane on its store (never
pickle), and a bulk channel (gloo on CPU, vLLM's `PyNcclCommunicator` on CUDA). NCCL runs without torch's
watchdog, so its setup (a peer that died would hold `ncclCommInitRank` forever) and broadcasts have a
deadline, through at most `NCCL_STAGING_SLOTS` staging pairs of `NCCL_CHUNK_BYTES` in this process."""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

BACKENDS = ("gloo", "nccl")
_POLL_S = (0.002, 0.05)  # first and longest sleep while polling the store
NCCL_CHUNK_BYTES = 32 << 20  # one NCCL broadcast; both ends split a flush the same way
NCCL_STAGING_SLOTS = 2  # staging buffer pairs held at once by this process, over every engine's group
_staging = threading.BoundedSemaphore(NCCL_STAGING_SLOTS)


class GroupTimeout(TimeoutError):
    """The peer did not answer within the group's timeout; the group is unusable."""


@dataclass
class Group:
    """This process's end of one engine's group (rank 0 is the trainer)."""

    spg: Any  # vllm.distributed.utils.StatelessProcessGroup
    backend: str
    timeout_s: float
    bulk: Any = None  # ProcessGroupGloo or PyNcclCommunicator
    seq: int = 0  # updates announced (trainer) or answered (engine) on this group
    bytes_sent: int = 0  # bulk bytes of the last update (trainer)
    refusal: dict[str, Any] | None = None  # the first refusing rank's answer to the last offer (trainer)
    _stream: Any = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.spg.rank

    def put(self, key: str, value: Any) -> None:
        self.spg.store.set(f"vllm-delta/{key}", json.dumps(value).encode())

    def get(self, key: str) -> Any:
        """Wait (at most the store's timeout) for `key`."""
        return json.loads(bytes(self.spg.store.get(f"vllm-delta/{key}")))

    def wait_all(self, keys: list[str], deadline: float, stop: Callable[[], bool]) -> list[Any] | None:
        """Every key's value, or None if `stop()` turned true first; `GroupTimeout` past `deadline`."""
        full = [f"vllm-delta/{k}" for k in keys]
        pause = _POLL_S[0]
        while not self.spg.store.check(full):
            if stop():
                return None
            if time.monotonic() > deadline:
                raise GroupTimeout(f"no answer to {keys} within {self.timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
        return [self.get(k) for k in keys]

    def send_bytes(self, data: bytes) -> None:
        if self.backend == "gloo":
            with warnings.catch_warnings(action="ignore", category=UserWarning):  # the root only reads it
                t = torch.frombuffer(data, dtype=torch.uint8)
            self.bulk.broadcast(t, 0).wait(datetime.timedelta(seconds=self.timeout_s))
        else:
            view = memoryview(data)
            with _staging:
                host, dev = self._staging_pair(len(data), pin=True)
                for a, n in chunks(len(data)):
                    host[:n].numpy()[:] = view[a : a + n]
                    with torch.cuda.stream(self._cuda_stream()):
                        dev[:n].copy_(host[:n], non_blocking=True)
                        self._nccl_broadcast(dev[:n])  # returns once done: both buffers are free again
                del host, dev
        self.bytes_sent += len(data)

    def recv_bytes(self, size: int) -> bytes:
        if self.backend == "gloo":
            t = torch.empty(size, dtype=torch.uint8)
            self.bulk.broadcast(t, 0).wait(datetime.timedelta(seconds=self.timeout_s))
            return t.numpy().tobytes()
        out = bytearray(size)  # the decoder reads host bytes
        with _staging:
            _, dev = self._staging_pair(size, pin=False)
            for a, n in chunks(size):
                with torch.cuda.stream(self._cuda_stream()):
                    self._nccl_broadcast(dev[:n])
                out[a : a + n] = dev[:n].cpu().numpy().tobytes()
            del dev
        return bytes(out)

    def _staging_pair(self, size: int, *, pin: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A host (pinned, if `pin`) and a device buffer of at most one chunk, on the caller's stream."""
        n = min(size, NCCL_CHUNK_BYTES)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True) if pin else None
        return host, torch.empty(n, dtype=torch.uint8, device=self.bulk.device)

    def _cuda_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.bulk.device)
        return self._stream

    def _nccl_broadcast(self, t: torch.Tensor) -> None:
        """NCCL broadcast on our stream, waited on with a deadline (no watchdog); abort on timeout."""
        self.bulk.broadcast(t, src=0, stream=self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.close()
                why = f"NCCL broadcast of {t.numel()} B did not finish within {self.timeout_s:.0f} s"
                raise GroupTimeout(why)
            time.sleep(_POLL_S[0])

    def close(self) -> None:
        """Drop the group; an NCCL communicator is aborted so no kernel waits on a gone peer."""
        bulk, self.bulk = self.bulk, None
        if bulk is not None and self.backend == "nccl":
            bulk.destroy()


def chunks(size: int, chunk: int = NCCL_CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each NCCL broadcast of a `size`-byte flush; the same on both ends."""
    return [(a, min(chunk, size - a)) for a in range(0, size, chunk)]


def listen(master_addr: str) -> socket.socket:
    """Rank 0's listening socket on a free port (the port goes to the engine in the init request)."""
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    return socket.create_server((master_addr, 0), family=family)  # SO_REUSEADDR set on POSIX


def host_group(
    sock: socket.socket,
    *,
    world_size: int,
    backend: str,
    timeout_s: float,
    refused: Callable[[], bool] = lambda: False,
) -> Group:
    """Rank 0: serve the store on `sock`, wait until every engine rank has joined (`ConnectionError` once
    `refused()`: the engine refused), then build the bulk channel with them."""
    from vllm.distributed.utils import StatelessProcessGroup, create_tcp_store

    host, port = sock.getsockname()[:2]
    store = create_tcp_store(
        host,
        port,
        listen_socket=sock,
        world_size=world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        use_libuv=False,
    )
    group = Group(StatelessProcessGroup(rank=0, world_size=world_size, store=store), backend, timeout_s)
    ranks = [f"joined/{r}" for r in range(1, world_size)]
    if group.wait_all(ranks, time.monotonic() + timeout_s, stop=refused) is None:
        raise ConnectionError("the engine refused to join")
    group.bulk = _bulk(group)
    return group


def join_group(
    *, master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> Group:
    """An engine rank: connect to the trainer's store, say so, then build the bulk channel."""
    from vllm.distributed.utils import StatelessProcessGroup

    spg = StatelessProcessGroup.create(
        master_addr, master_port, rank, world_size, store_timeout=max(1, int(timeout_s))
    )
    group = Group(spg, backend, timeout_s)
    group.put(f"joined/{rank}", True)
    group.bulk = _bulk(group)
    return group


def _bulk(group: Group) -> Any:
    """The bulk channel, or `GroupTimeout` if it is not set up within the group's timeout."""
    built: Future = Future()

    def build() -> None:
        try:
            if group.backend == "gloo":
                import torch.distributed as dist

                store = dist.PrefixStore("vllm-delta-gloo", group.spg.store)
                timeout = datetime.timedelta(seconds=group.timeout_s)
                built.set_result(dist.ProcessGroupGloo(store, group.rank, group.spg.world_size, timeout))
                return
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

            comm = PyNcclCommunicator(group.spg, device=torch.device("cuda", torch.cuda.current_device()))
            if comm.disabled:
                raise RuntimeError("NCCL is not available to PyNcclCommunicator here")
            built.set_result(comm)
        except BaseException as exc:
            built.set_exception(exc)

    threading.Thread(target=build, name="vllm-delta-bulk-init", daemon=True).start()
    try:
        return built.result(timeout=group.timeout_s)
    except FutureTimeout:

        def abort_late(f: Future) -> None:  # set up after its caller gave up: nobody will use it
            if f.exception() is None and group.backend == "nccl":
                f.result().destroy()

        built.add_done_callback(abort_late)
        why = f"the {group.backend} channel was not set up within {group.timeout_s:.0f} s (a peer joined"
        raise GroupTimeout(why + " the store, then went away or stopped)") from None
