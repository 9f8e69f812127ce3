"""The sender's flush spool for collective transports: a bounded window in memory, the rest on disk.

Why: the handshake needs the whole manifest (digests, lineage, sizes) before any bulk byte moves,
so every flush is encoded before the first broadcast. Holding them all in RAM would make the
sender's memory grow with the delta (an anchor is the whole model); past `window_bytes` they go to
an unlinked temporary file instead. Reads use `os.pread`, so concurrent per-engine send threads
share one spool without a lock on a file position.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator

DEFAULT_WINDOW_BYTES = 256 << 20


class FlushSpool:
    """Encoded flushes by name, in arrival order."""

    def __init__(self, window_bytes: int = DEFAULT_WINDOW_BYTES, directory: str | None = None) -> None:
        self.window_bytes, self.directory = window_bytes, directory
        self._memory: dict[str, bytes] = {}
        self._disk: dict[str, tuple[int, int]] = {}  # name -> (offset, size) in the temp file
        self._order: list[str] = []
        self._fd: int | None = None
        self._end = 0
        self._held = 0
        self._lock = threading.Lock()

    def add(self, name: str, data: bytes) -> None:
        with self._lock:
            if name in self._memory or name in self._disk:
                raise ValueError(f"flush {name!r} is already spooled")
            self._order.append(name)
            if self._held + len(data) <= self.window_bytes:
                self._memory[name] = bytes(data)
                self._held += len(data)
                return
            if self._fd is None:
                fd, path = tempfile.mkstemp(prefix="vllm-delta-spool-", dir=self.directory)
                os.unlink(path)  # gone with the last descriptor, whatever happens to this process
                self._fd = fd
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(self._fd, view[written:], self._end + written)
            self._disk[name] = (self._end, len(data))
            self._end += len(data)

    @property
    def names(self) -> list[str]:
        return list(self._order)

    @property
    def held_bytes(self) -> int:
        """Bytes held in memory (at most `window_bytes`)."""
        return self._held

    @property
    def spilled_bytes(self) -> int:
        return self._end

    def size(self, name: str) -> int:
        return len(self._memory[name]) if name in self._memory else self._disk[name][1]

    def read(self, name: str) -> bytes:
        if name in self._memory:
            return self._memory[name]
        offset, size = self._disk[name]
        out = bytearray(size)
        view, got = memoryview(out), 0
        while got < size:
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n <= 0:
                raise OSError(f"spool file ended at {offset + got}, flush {name!r} needs {size} B")
            got += n
        return bytes(out)

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        for name in self.names:
            yield name, self.read(name)

    def close(self) -> None:
        with self._lock:
            self._memory.clear()
            self._held = 0
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
