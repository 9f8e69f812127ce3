"""Engine status asked in the background, so the training thread never waits on a dead or hung engine.

Why: the planner must ask an engine whose state is unknown (a failed update, a restart, a new
engine) where it stands before sending it anything. Asked on the training thread, while every
rank waits in the plan's broadcast, a dead engine cost its connect retries every sync and a hung
one the client's whole timeout. Here each engine has at most one probe in flight, on a daemon
thread of its own; the planner takes whatever answers are in and skips the engines still being
asked, so a probe costs the step nothing and at most one thread per engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, wait
from typing import Any

from vllm_delta.client import Reply


class Prober:
    """At most one status probe in flight per engine; answers are taken once."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._probes: dict[str, Future] = {}
        self.started = 0  # probes started, for tests and metrics

    def start(self, urls: Iterable[str]) -> None:
        """Ask each engine's status unless a probe of it is already out."""
        with self._lock:
            for url in urls:
                if url in self._probes:
                    continue
                future: Future = Future()
                self._probes[url] = future
                self.started += 1
                threading.Thread(
                    target=self._probe, args=(url, future), name="vllm-delta-probe", daemon=True
                ).start()

    def _probe(self, url: str, future: Future) -> None:
        try:
            future.set_result(self.client.status([url])[url])
        except BaseException as exc:  # a client error is an answer too: unreachable
            future.set_result(Reply(url, 0, {"error": {"type": type(exc).__name__, "message": str(exc)}}))

    def take(self, urls: Iterable[str], wait_s: float | None, *, fresh: bool = False) -> dict[str, Reply]:
        """The answers of `urls` that are in after waiting at most `wait_s` (None: until all are);
        a probe is started for any not yet asked. `fresh`: a new probe for every one of them, since
        an answer, or a probe still in flight, may predate the caller's question (a probe that began
        while the engine was down answers "unreachable" after it came back). Taken answers are
        forgotten."""
        urls = list(urls)
        if fresh:
            with self._lock:
                for u in urls:
                    self._probes.pop(u, None)  # an older probe still running sets a future no one reads
        self.start(urls)
        with self._lock:
            futures = {u: self._probes[u] for u in urls}
        if futures and wait_s != 0:
            wait(futures.values(), timeout=wait_s)
        out = {}
        with self._lock:
            for url, future in futures.items():
                if future.done():
                    out[url] = future.result()
                    del self._probes[url]
        return out

    def pending(self) -> list[str]:
        with self._lock:
            return [u for u, f in self._probes.items() if not f.done()]
