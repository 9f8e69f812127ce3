"""Disk transport: flush files in a version directory, each written atomically, the manifest last (a sender
that died mid-write leaves none: engines refuse it); the engine's half is the wire's reader (`open_delta`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from vllm_delta.transports.base import SentDelta, StoredTransport, Throttle, TransportOptions
from vllm_delta.wire import MANIFEST_NAME, write_manifest
from vllm_delta.wire.manifest import write_atomic


class DiskTransport(StoredTransport):
    """Flush files under `delta_dir/<version dir>`."""

    def __init__(self, name: str, options: TransportOptions) -> None:
        if options.delta_dir is None:
            raise ValueError("the disk transport needs delta_dir")
        self.delta_dir, self.keep = Path(options.delta_dir), options.keep
        self.throttle_bytes_per_s = options.throttle_bytes_per_s

    def prepare(self, name: str) -> None:
        """An empty version directory (a leftover one, e.g. of a sender that died, is replaced)."""
        shutil.rmtree(self.delta_dir / name, ignore_errors=True)
        (self.delta_dir / name).mkdir(parents=True)

    def writer(self, name: str) -> Callable[[str, bytes], None]:
        pace = Throttle(self.throttle_bytes_per_s).wait if self.throttle_bytes_per_s else None
        return lambda file, data: write_atomic(self.delta_dir / name / file, data, pace)

    def seal(self, sent: SentDelta) -> None:
        write_manifest(self.delta_dir / sent.location, sent.manifest)

    def cleanup(self, sent: list[SentDelta]) -> None:
        """Delete the delivered version directories, manifest first so no reader sees one as finished."""
        if not self.keep:
            for s in sent:
                (self.delta_dir / s.location / MANIFEST_NAME).unlink(missing_ok=True)
                shutil.rmtree(self.delta_dir / s.location, ignore_errors=True)
