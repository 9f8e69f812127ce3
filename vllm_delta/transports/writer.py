"""Writing flushes while the next is encoded: a background writer thread, and a pace for slow links.

Why shared: the disk transport writes each flush to a file and the s3 transport uploads it as an
object, both on a thread of their own so encoding the next flush overlaps moving this one; the
same `Throttle` paces a file write, an upload (`store.py`) and the benchmarks' modelled link.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from vllm_delta.wire import EncodedFlush


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


class BackgroundFlushWriter:
    """Hands each flush to `write(name, data)` on a background thread, so the sender encodes the next
    one meanwhile; `emit` blocks only if `depth` are queued. The first error stops the writes and is
    raised, as it was, by the next `emit` or by `close`. Both stored transports write through one of
    these: to a file (transports/disk.py) or to an object store (transports/s3.py)."""

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
